"""The core's unfinished requests: where each one begins and every way it ends.

The core sees one sequence per request (a user request's `n` completions are `n` requests to it; the
front end fans them out and in). A request ends finished, aborted, failed or refused; each way releases
what it holds everywhere at once: its scheduler entry and KV blocks, its adapter's pin and hold, its
sampler generator, grammar matcher and speculative state. The deltas of requests that end between steps
(aborted, refused, failed by an adapter or by their grammar) wait in `pending` for the next step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from engine.core.engine_metrics import EngineCounters
from engine.core.request_checks import RequestError
from engine.core.step_outputs import LiveRequest, append_tokens, refused_delta
from engine.lora.manager import AdapterManager
from engine.messages import RequestDelta
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
    ) -> None:
        self.scheduler = scheduler
        self.lora = lora
        self.structured = structured
        self.sampler = sampler
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.counters = counters
        self.live: dict[str, LiveRequest] = {}  # request id -> its record
        self.pending: list[RequestDelta] = []  # refused or aborted requests, sent with the next step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.live

    def queue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        meta: RequestMeta,
        counts_prompt: bool = True,
    ) -> None:
        """Queue a checked request; a ValueError of the scheduler (what can never fit the KV cache)
        refuses it."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            adapter_id=adapter_id,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            meta=meta,
        )
        self.structured.add(request)  # its grammar compiles off the loop; the scheduler waits for it
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:  # the scheduler's "can never fit" is this request's (lower max_tokens)
            self.structured.free(request_id)
            code = exc.code if isinstance(exc, RequestError) else "invalid_request"
            self.refuse(request_id, str(exc), code)
            return
        self.live[request_id] = LiveRequest(request, counts_prompt)
        if adapter_id is not None:
            self.lora.hold(adapter_id)
            request.adapter_cold = self.lora.prefetch(adapter_id)

    def append(self, kept: Iterable[tuple[Request, list, list]]) -> list[RequestDelta]:
        """Append a step's kept tokens, (request, token ids, their logprobs) per request, to the requests
        still unfinished: stop checks, finishes, and each request's delta."""
        deltas = []
        for request, token_ids, token_logprobs in kept:
            request.num_in_flight = max(0, request.num_in_flight - 1)
            live = self.live.get(request.request_id)
            if live is None or live.request is not request or request.is_finished:
                continue  # finished (aborted, failed) while its token was in flight
            num_before = request.num_output_tokens
            status, logprobs = append_tokens(
                live,
                token_ids,
                token_logprobs,
                self.max_model_len,
                self.structured,
                self.counters.count_token,
            )
            if status is not None:
                self.finish(request, status)
            deltas.append(live.delta(request.output_token_ids[num_before:], logprobs))
            if status is not None:
                self.forget(request.request_id)
        return deltas

    def refuse(self, request_id: str, message: str, error_code: str | None = None) -> None:
        """A request refused before it was queued: its one delta, failed with `message` (and
        `error_code` when the request's own data is at fault)."""
        logger.warning("request %s refused: %s", request_id, message)
        self.pending.append(refused_delta(request_id, message, error_code))

    def admit_compiled(self) -> None:
        """Requests whose grammar compiled become schedulable; those whose spec failed fail alone (their
        deltas wait in `pending`)."""
        _, failed = self.structured.poll()
        for request, error in failed:
            live = self.live.get(request.request_id)
            if live is None or live.request is not request or request.is_finished:
                continue
            request.error, request.error_code = str(error), error.code
            self._end(live, RequestStatus.FINISHED_ERROR)

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            live = self.live.get(request_id)
            if live is not None and not live.request.is_finished:
                self._end(live, RequestStatus.FINISHED_ABORTED)

    def fail_waiting(self, adapter_id: str, reason: str, include_preempted: bool) -> None:
        """Fail the waiting requests of one adapter with `reason`, nothing else: those never admitted,
        and with `include_preempted` also those that ran before and wait to be recomputed."""
        for request in [
            r
            for r in self.scheduler.waiting
            if r.adapter_id == adapter_id and (include_preempted or r.status is RequestStatus.WAITING)
        ]:
            request.error = reason
            self._end(self.live[request.request_id], RequestStatus.FINISHED_ERROR)

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
        """End a request: release everything it holds but its record (`forget` drops that)."""
        self.unpin(request)
        self.scheduler.finish_request(request.request_id, status)
        request.status = status
        self.sampler.free(request.request_id)
        self.structured.free(request.request_id)
        if self.speculator is not None:
            self.speculator.free(request.request_id)

    def forget(self, request_id: str) -> None:
        live = self.live.pop(request_id)
        if live.request.adapter_id is not None:
            self.lora.unhold(live.request.adapter_id)

    def _end(self, live: LiveRequest, status: RequestStatus) -> None:
        """End a request between steps: its final delta waits in `pending`."""
        self.finish(live.request, status)
        self.pending.append(live.delta([], []))
        self.forget(live.request.request_id)
