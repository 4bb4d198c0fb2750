"""The synchronous engine: the engine core in the caller's process, behind the front end's output path.

As vLLM's LLMEngine: user requests go in through the same front-end processing the server's AsyncLLM
uses (engine/frontend/output_processor.py: tokenizing, the `n > 1` fan-out into child requests, then
text, stop strings, logprobs and the fan-in), and the core (engine/engine_core.py) runs the steps and
sends token deltas. A stop string ends a request here, which aborts its sequences in the core.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import EngineConfig
from engine.core.request_checks import RequestError
from engine.engine_core import AdapterSourceFactory, EngineCore
from engine.frontend.output_processor import OutputProcessor, Prompt, new_request
from engine.outputs import RequestOutput
from engine.request_meta import RequestMeta, with_priority
from engine.sampling_params import SamplingParams

__all__ = ["OUTPUT_KINDS", "AdapterSourceFactory", "LLMEngine", "Prompt", "RequestError"]

# "cumulative": each output holds everything generated so far; "delta": only what is new since the last.
OUTPUT_KINDS = ("cumulative", "delta")


class LLMEngine(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        skip_tokenizer_init: bool = False,
        adapter_source=None,
        adapter_observer=None,
        adapter_source_factory: AdapterSourceFactory | None = None,
        detokenize: bool = True,
        output_kind: str = "cumulative",
    ):
        """`detokenize=False`: outputs carry token ids only (no text, no stop strings); the tokenizer is
        still loaded for structured outputs.

        `output_kind="delta"` (vLLM's RequestOutputKind.DELTA): each output carries only the text, tokens
        (and logprobs) new since the request's previous output, so a step costs the same at every length."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)} (got {output_kind!r})")
        super().__init__(
            config,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            adapter_source=adapter_source,
            adapter_observer=adapter_observer,
            adapter_source_factory=adapter_source_factory,
        )
        self.output_kind = output_kind
        self._detokenize = detokenize
        self._outputs = OutputProcessor()

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        adapter: str | None = None,
        *,
        meta: RequestMeta | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. A request that cannot be served is reported as a failed output at the next
        step instead of raising, so one bad request never disturbs a batch.

        `meta`: its tenant, the tenant's weight, its priority and cache salt (engine/request_meta.py;
        default: the shared "default" tenant, weight 1, priority 0, unsalted). `priority` is vLLM's
        argument, the same as `meta.priority`. A non-zero priority under a policy that does not use it
        raises RequestError, as vLLM refuses it."""
        self._check_open()
        meta = with_priority(meta, priority)
        self.check_meta(meta)
        request, failed = new_request(
            request_id,
            prompt,
            params or SamplingParams(),
            adapter,
            self.tokenizer,
            self.eos_token_ids,
            cumulative=self.output_kind == "cumulative",
            detokenize=self._detokenize,
        )
        self._outputs.add(request, failed)
        if failed is None:
            for child in request.add_requests(meta):
                self.add_core_request(child)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.abort_core_requests(self._outputs.child_ids(ids))

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or (not self.closed and self._outputs.has_pending)

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns what changed for each request (one output per request).

        With `async_scheduling` the step's sampled tokens stay in flight: the host schedules and launches
        the next step (reading those tokens on the device) before it waits for them, so the GPU is not
        idle while the host does its bookkeeping; each call then returns the previous step's results.

        Under tensor parallelism a step a worker's death or hang cut short raises TensorParallelError
        (engine/parallel/workers.py) instead of returning outputs; the engine cannot step again.
        """
        outputs, ended = self._outputs.process(self.core_step())
        self.abort_core_requests(ended)  # a stop string ended them here
        return outputs
