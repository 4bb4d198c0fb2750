"""Per-request grammar matchers: compile off the loop, mask each step's logits, advance with the sampled tokens.

A request's grammar compiles on the compile pool (compile_pool.py) while the request waits in the
scheduler (`Request.grammar_pending`); `poll` hands back each step the requests whose grammar is ready
and those whose spec failed (invalid, past the budget or the compile timeout), which fail alone.

Each step a constrained row allows the tokens its grammar allows, within the request's own limits:
its `allowed_token_ids`, and no stop token before `min_tokens` (the sampler masks those, engine/sampler.py).
A row left with no token at all (a grammar whose language is empty, a regex that `allowed_token_ids`
cannot spell, a grammar that must end before `min_tokens`) fails its request with SpecUnsatisfiable,
the caller's error, instead of sampling from nothing; checked when the grammar is ready (before the
request runs) and at every step. The masks are filled on the host right after the step's forward pass
is launched, while the GPU computes the logits (vLLM does the same).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for_futures
from typing import Any

import numpy as np
import torch

from engine.request import Request
from engine.stop_checker import may_stop_at
from engine.structured_output.budget import SpecUnsatisfiable, StructuredOutputError
from engine.structured_output.compile_pool import (
    DEFAULT_COMPILE_THREADS,
    DEFAULT_COMPILE_TIMEOUT_S,
    Compilation,
    GrammarCompilePool,
)

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        compile_threads: int = DEFAULT_COMPILE_THREADS,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compile_threads = compile_threads
        self._compile_timeout_s = compile_timeout_s
        self._pool: GrammarCompilePool | None = None  # built on the first structured request
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher
        self._compiling: dict[str, tuple[Request, Compilation]] = {}  # request id -> its grammar's compile
        self._allowed: dict[str, torch.Tensor] = {}  # request id -> bitmask row of its allowed_token_ids
        self._dead_ends: dict[str, str] = {}  # request id -> why its row allowed no token (failed at accept)

    # -- compiling --------------------------------------------------------------------------------

    def add(self, request: Request) -> bool:
        """Start the request's grammar (compiled or cached); True when the request needs none. A request
        with a grammar waits with `grammar_pending` set until `poll` says it is ready."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return True
        if self._tokenizer is None:
            raise StructuredOutputError("structured outputs need the model's tokenizer; this engine has none")
        if self._pool is None:
            self._pool = GrammarCompilePool(
                self._tokenizer,
                self._vocab_size,
                self._stop_token_ids,
                num_threads=self._compile_threads,
                timeout_s=self._compile_timeout_s,
            )
        self._compiling[request.request_id] = (request, self._pool.submit(params))
        request.grammar_pending = True
        return False

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def poll(self) -> tuple[list[Request], list[tuple[Request, StructuredOutputError]]]:
        """(requests whose grammar is ready, now schedulable; requests whose spec failed, with why)."""
        ready: list[Request] = []
        failed: list[tuple[Request, StructuredOutputError]] = []
        now = time.monotonic()
        for request_id, (request, compilation) in list(self._compiling.items()):
            future = compilation.future
            if not future.done():
                if self._pool is not None and self._pool.expired(compilation, now):
                    failed.append((request, self._pool.give_up(compilation)))
                    del self._compiling[request_id]
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                try:
                    self._start(request, future.result())
                except StructuredOutputError as exc:
                    error = exc
            if error is None:
                request.grammar_pending = False
                ready.append(request)
            else:
                failed.append((request, _as_spec_error(error)))
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a compile to finish (the loop has nothing else to run)."""
        futures = [c.future for _, c in self._compiling.values()]
        if futures:
            wait_for_futures(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _start(self, request: Request, compiled: Any) -> None:
        """The request's matcher, once its first token has somewhere to go (SpecUnsatisfiable if not)."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(compiled)
        allowed = request.sampling_params.allowed_token_ids
        if allowed:
            self._allowed[request.request_id] = _bits(allowed, self._vocab_size)
        bitmask = xgrammar.allocate_token_bitmask(1, self._vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        reason = self._no_token_left(request, bitmask[0])
        if reason is not None:
            self._allowed.pop(request.request_id, None)
            raise SpecUnsatisfiable(reason)
        self._matchers[request.request_id] = matcher

    # -- each step --------------------------------------------------------------------------------

    def prepare(self, requests: list[Request]):
        """The step's token bitmask ([num_rows, ceil(vocab/32)] int32, on the host), or None if no row is
        constrained. Rows without a grammar allow every token."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(requests), self._vocab_size)  # all allowed
        for i in rows:
            request = requests[i]
            matcher = self._matchers[request.request_id]
            if matcher.is_terminated():
                continue
            matcher.fill_next_token_bitmask(bitmask, i)
            reason = self._no_token_left(request, bitmask[i])
            if reason is not None:  # sample it freely; `accept` fails the request with the reason
                self._dead_ends[request.request_id] = reason
                bitmask[i].fill_(-1)
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
        reason = self._dead_ends.pop(request.request_id, None)
        if reason is not None:
            raise SpecUnsatisfiable(reason)
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} does not follow the requested structure")
        return matcher.is_terminated()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._compiling.pop(request_id, None)
        self._allowed.pop(request_id, None)
        self._dead_ends.pop(request_id, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def _no_token_left(self, request: Request, row: torch.Tensor) -> str | None:
        """Why no token may come next in this row ([ceil(vocab/32)] int32 of what the grammar allows),
        given the request's own limits; None when some token may."""
        if not bool(row.any()):
            return "the structured output allows no token here: its language is empty from this point"
        allowed = self._allowed.get(request.request_id)
        if allowed is not None:
            row = row & allowed
            if not bool(row.any()):
                return "no token of allowed_token_ids can continue the structured output"
        params = request.sampling_params
        position = request.num_output_tokens + request.num_in_flight + 1
        if params.min_tokens and not may_stop_at(position, params):
            stops = list(params.stop_token_ids)
            if request.eos_token_id is not None:
                stops.append(request.eos_token_id)
            if not bool((row & ~_bits(stops, self._vocab_size)).any()):
                return (
                    f"the structured output must end after {position - 1} tokens, before min_tokens="
                    f"{params.min_tokens}; lower min_tokens or allow a longer output"
                )
        return None


def _bits(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row ([ceil(vocab/32)] int32, xgrammar's layout) with these tokens' bits set."""
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    ids = np.asarray([t for t in token_ids if 0 <= t < vocab_size], dtype=np.int64)
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return torch.from_numpy(words.view(np.int32))


def _as_spec_error(error: BaseException) -> StructuredOutputError:
    if isinstance(error, StructuredOutputError):
        return error
    return StructuredOutputError(f"the structured output cannot be compiled: {error}")
