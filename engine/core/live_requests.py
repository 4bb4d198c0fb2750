"""The engine's unfinished requests: where each one begins and every way it ends.

A user request with `n` completions is queued as `n` child requests (ids `req#i` when n > 1), each with
its output state (engine/output_processor.py). A request ends finished, aborted, failed or refused;
each way releases what it holds everywhere at once: its scheduler entry and KV blocks, its adapter's
pin and hold, its sampler generator, grammar matcher and speculative state. Outputs of requests that
end between steps (aborted, refused, failed by an adapter or by their grammar) wait in `pending` for
the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from engine.core.engine_metrics import EngineCounters
from engine.core.request_checks import RequestError, child_params
from engine.core.step_outputs import append_tokens, refused_output
from engine.detokenizer import IncrementalDetokenizer
from engine.lora.manager import AdapterManager
from engine.output_processor import ParentRequest, RequestState
from engine.outputs import RequestOutput
from engine.request import NO_LORA, Request, RequestStatus
from engine.request_meta import RequestMeta
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.speculator import Speculator
from engine.structured_output.matchers import StructuredOutputs

logger = logging.getLogger(__name__)


class LiveRequests:
    def __init__(
        self,
        scheduler: Scheduler,
        lora: AdapterManager,
        structured: StructuredOutputs,
        sampler: Sampler,
        speculator: Speculator | None,
        eos_token_ids: list[int],
        max_model_len: int,
        counters: EngineCounters,
        detokenizer_tokenizer,  # None: outputs carry token ids only
        delta_outputs: bool,
    ) -> None:
        self.scheduler = scheduler
        self.lora = lora
        self.structured = structured
        self.sampler = sampler
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.counters = counters
        self.detokenizer_tokenizer = detokenizer_tokenizer
        self.delta_outputs = delta_outputs
        self.states: dict[str, RequestState] = {}  # child request id -> state
        self.parents: dict[str, list[str]] = {}  # user request id -> child ids
        self.pending: list[RequestOutput] = []  # refused or aborted requests, reported at the next step

    def queue(
        self,
        parent: ParentRequest,
        params: SamplingParams,
        adapter_id: str | None,
        meta: RequestMeta,
    ) -> None:
        """Queue the children of a checked request; a ValueError (the scheduler refuses what can never
        fit the KV cache) refuses the whole request."""
        try:
            children = [self._new_child(parent, params, index, adapter_id, meta) for index in range(params.n)]
        except ValueError as exc:  # the scheduler's "can never fit" is this request's (lower max_tokens)
            self.refuse(
                parent.request_id,
                parent.prompt,
                parent.prompt_token_ids,
                parent.adapter,
                str(exc),
                exc.code if isinstance(exc, RequestError) else "invalid_request",
            )
            return
        self.parents[parent.request_id] = [child.request_id for child in children]
        if adapter_id is not None:
            cold = self.lora.prefetch(adapter_id)
            for child in children:
                child.adapter_cold = cold

    def append(self, kept: Iterable[tuple[Request, list, list]]) -> list[RequestOutput]:
        """Append a step's kept tokens, (request, token ids, their logprobs) per request, to the requests
        still unfinished: stop checks, finishes, and each request's output."""
        outputs = []
        for request, token_ids, token_logprobs in kept:
            request.num_in_flight = max(0, request.num_in_flight - 1)
            state = self.states.get(request.request_id)
            if state is None or state.request is not request or request.is_finished:
                continue  # finished (aborted, failed) while its token was in flight
            status = append_tokens(
                state,
                token_ids,
                token_logprobs,
                self.max_model_len,
                self.structured,
                self.counters.count_token,
            )
            if status is not None:
                self.finish(request, status)
            outputs.append(state.publish())
            if status is not None:
                self.forget(request.request_id)
        return outputs

    def refuse(
        self, request_id, prompt_text, prompt_ids, adapter, message: str, error_code: str | None = None
    ) -> None:
        """A request refused before it was queued: its one output, failed with `message` (and
        `error_code` when the request's own data is at fault)."""
        logger.warning("request %s refused: %s", request_id, message)
        self.pending.append(refused_output(request_id, prompt_text, prompt_ids, adapter, message, error_code))

    def admit_compiled(self) -> None:
        """Requests whose grammar compiled become schedulable; those whose spec failed fail alone (their
        outputs wait in `pending`)."""
        _, failed = self.structured.poll()
        for request, error in failed:
            state = self.states.get(request.request_id)
            if state is None or state.request is not request or request.is_finished:
                continue
            request.error, request.error_code = str(error), error.code
            self.finish(request, RequestStatus.FINISHED_ERROR)
            self.pending.append(state.publish())
            self.forget(request.request_id)

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            for child_id in self.parents.get(request_id, []):
                state = self.states.get(child_id)
                if state is None or state.request.is_finished:
                    continue
                self.finish(state.request, RequestStatus.FINISHED_ABORTED)
                self.pending.append(state.publish())
                self.forget(child_id)

    def fail_waiting(self, adapter_id: str, reason: str, include_preempted: bool) -> None:
        """Fail the waiting requests of one adapter with `reason`, nothing else: those never admitted,
        and with `include_preempted` also those that ran before and wait to be recomputed."""
        for request in [
            r
            for r in self.scheduler.waiting
            if r.adapter_id == adapter_id and (include_preempted or r.status is RequestStatus.WAITING)
        ]:
            request.error = reason
            self.finish(request, RequestStatus.FINISHED_ERROR)
            state = self.states[request.request_id]
            self.pending.append(state.publish())
            self.forget(request.request_id)

    def pin(self, request: Request) -> None:
        """It starts running: its adapter's slot stays on the GPU until `unpin`."""
        if request.adapter_id is not None:
            request.lora_slot = self.lora.acquire(request.adapter_id)

    def unpin(self, request: Request) -> None:
        if request.adapter_id is None or request.lora_slot == NO_LORA:
            return
        self.lora.release(request.adapter_id)
        request.lora_slot = NO_LORA

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request: release everything it holds but its output state (`forget` drops that)."""
        self.unpin(request)
        self.scheduler.finish_request(request.request_id, status)
        request.status = status
        self.sampler.free(request.request_id)
        self.structured.free(request.request_id)
        if self.speculator is not None:
            self.speculator.free(request.request_id)

    def forget(self, child_id: str) -> None:
        state = self.states.pop(child_id)
        if state.request.adapter_id is not None:
            self.lora.unhold(state.request.adapter_id)
        parent_id = state.parent.request_id
        if state.parent.finished:
            self.parents.pop(parent_id, None)

    def _new_child(
        self,
        parent: ParentRequest,
        params: SamplingParams,
        index: int,
        adapter_id: str | None,
        meta: RequestMeta,
    ) -> Request:
        child_id = parent.request_id if params.n == 1 else f"{parent.request_id}#{index}"
        child = Request(
            request_id=child_id,
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=child_params(params, index, self.eos_token_ids),
            adapter_id=adapter_id,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            meta=meta,
        )
        self.structured.add(child)  # its grammar compiles off the loop; the scheduler waits for it
        try:
            self.scheduler.add_request(child)
        except ValueError:
            self.structured.free(child_id)
            raise
        if adapter_id is not None:
            self.lora.hold(adapter_id)
        tokenizer = self.detokenizer_tokenizer
        detok = IncrementalDetokenizer(tokenizer, child) if tokenizer else None
        self.states[child_id] = RequestState(child, parent, index, detok, delta=self.delta_outputs)
        return child
