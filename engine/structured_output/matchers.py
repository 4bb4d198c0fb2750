"""Per-request grammar matchers: mask each step's logits, then advance with the sampled tokens.

The masks are filled on the host right after the step's forward pass is launched, while the GPU computes
the logits, so they cost the step nothing where the host would otherwise wait (vLLM does the same).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.request import Request
from engine.structured_output.grammars import GrammarCompiler

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: GrammarCompiler | None = None  # built on the first structured request
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher

    def add(self, request: Request) -> None:
        """Compile the request's grammar and give it a matcher; ValueError for an invalid spec."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self._tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this engine has none")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
        self._matchers[request.request_id] = self._compiler.matcher(self._compiler.compile(params))

    def prepare(self, requests: list[Request]):
        """The step's token bitmask ([num_rows, ceil(vocab/32)] int32, on the host), or None if no row is
        constrained. Rows without a grammar allow every token."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(requests), self._vocab_size)  # all allowed
        for i in rows:
            matcher = self._matchers[requests[i].request_id]
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask, rows

    @staticmethod
    def apply(logits: torch.Tensor, prepared) -> torch.Tensor:
        """Disallowed tokens of the constrained rows to -inf (in place; logits [num_rows, vocab])."""
        if prepared is None:
            return logits
        import xgrammar

        bitmask, rows = prepared
        # Plain torch ops on the GPU: xgrammar's own kernels would be compiled on first use, after /ready.
        backend = "cpu" if logits.device.type == "cpu" else "torch_native"
        with torch.inference_mode():  # the runner's logits are inference tensors
            xgrammar.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), indices=rows, backend=backend
            )
        return logits

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance the request's matcher; True when the grammar is complete (the request should stop)."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} does not follow the requested structure")
        return matcher.is_terminated()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
