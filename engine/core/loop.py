"""The engine core's busy loop: take inputs, schedule -> execute -> update (LLMEngine.step), send outputs.

The loop blocks on its input socket only while it has nothing to run; while requests run it only
drains what has arrived and steps again. Each step's results go out as one StepOutputs message.
One request's bad data fails that request alone (AddRequest errors become a failed RequestDelta); an
exception out of `LLMEngine.step` is an engine bug and ends the loop (the process reports it and exits).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from engine.llm_engine import LLMEngine
from engine.messages import (
    AbortRequests,
    AdapterEvent,
    AddRequest,
    ForgetAdapter,
    PreloadAdapters,
    RequestDelta,
    ShutdownCore,
    StepOutputs,
    UnpinAdapters,
    decode_input,
    encode,
)
from engine.outputs import RequestOutput
from engine.request import RequestStatus

logger = logging.getLogger(__name__)

# How long an idle core waits for input before it looks at its adapter loads and stats again.
IDLE_POLL_MS = 50


class EngineCoreLoop:
    """Runs one LLMEngine (built without a tokenizer) behind an input and an output socket."""

    def __init__(
        self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket, adapter_events: list[AdapterEvent]
    ):
        if engine.output_kind != "delta":
            raise ValueError(
                "the engine core loop sends each step's new tokens: build the engine with output_kind='delta'"
            )
        self.engine = engine
        self._inputs = inputs
        self._outputs = outputs
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)
        # Appended to by the adapter manager's observer (engine and loader threads); drained per message.
        self._adapter_events = adapter_events
        self._drain_source = getattr(engine.lora.source, "drain", None)
        self._failed: list[RequestDelta] = []  # requests refused on arrival, sent with the next message
        self._last_stats = None
        self._stopping = False

    def run(self) -> None:
        """Serve until a ShutdownCore message arrives."""
        while not self._stopping:
            busy = self.engine.has_unfinished_requests()
            self._receive(0 if busy else IDLE_POLL_MS)
            if self._stopping:
                return
            if self.engine.has_unfinished_requests():
                step = self.engine.step()
            else:
                self.engine.advance_adapters()  # preloads land while idle
                step = []
            self._send([self._delta(output) for output in step])

    # -- inputs -----------------------------------------------------------------------------------

    def _receive(self, timeout_ms: int) -> None:
        if not self._poller.poll(timeout_ms):
            return
        while not self._stopping:
            try:
                frames = self._inputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for data in frames:  # one frame per message; the front end sends related ones together
                try:
                    message = decode_input(data)
                except msgspec.ValidationError as exc:
                    self._refuse_undecodable(data, exc)
                    continue
                self._handle(message)

    def _handle(self, message) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self.engine.abort_request(message.request_ids)
        elif isinstance(message, ForgetAdapter):
            self.engine.forget_adapter(message.adapter_id)
        elif isinstance(message, PreloadAdapters):
            self.engine.preload_adapters(message.adapter_ids, message.level, message.pin)
        elif isinstance(message, UnpinAdapters):
            self.engine.unpin_adapters(message.adapter_ids, message.unload)
        elif isinstance(message, ShutdownCore):
            self._stopping = True

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                message.adapter,
                tenant=message.tenant,
                tenant_weight=message.tenant_weight,
                cache_salt=message.cache_salt,
            )
        except ValueError as exc:  # this request's data (params, a duplicate id): fail it, keep serving
            self._refuse(message.request_id, str(exc))
            return
        except Exception as exc:  # a bug met by this request's data: still this request alone
            logger.exception("adding request %s failed", message.request_id)
            self._refuse(message.request_id, f"the request could not start: {exc}")
            return

    def _refuse_undecodable(self, data: bytes, error: Exception) -> None:
        """A message that does not decode (e.g. params its __post_init__ refuses): fail its request if it
        names one; anything else is a front-end bug, logged and dropped."""
        raw = msgspec.msgpack.decode(data)
        request_id = raw.get("request_id") if isinstance(raw, dict) and raw.get("type") == "add" else None
        if isinstance(request_id, str):
            self._refuse(request_id, f"invalid request: {error}")
        else:
            logger.error("dropped an input message that does not decode: %s", error)

    def _refuse(self, request_id: str, reason: str) -> None:
        logger.warning("request %s refused: %s", request_id, reason)
        self._failed.append(RequestDelta(request_id, [], finish_reason="error", error=reason))

    # -- outputs ----------------------------------------------------------------------------------

    def _delta(self, output: RequestOutput) -> RequestDelta:
        """`output` as a message (one sequence: the core never sees n > 1; the engine's outputs are deltas)."""
        completion = output.outputs[0]
        finish_reason = completion.finish_reason
        stopped_by_token = finish_reason == RequestStatus.FINISHED_STOPPED.finish_reason
        return RequestDelta(
            request_id=output.request_id,
            new_token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason if stopped_by_token else None,
            error=output.error,
            num_cached_tokens=output.num_cached_tokens,
            prompt_logprobs=output.prompt_logprobs,  # a delta output carries them once
            times=completion.times,
        )

    def _send(self, deltas: list[RequestDelta]) -> None:
        if self._failed:
            deltas, self._failed = self._failed + deltas, []
        events = _take_all(self._adapter_events)
        records = self._drain_source() if self._drain_source is not None else []
        stats = self.engine.stats()
        if not deltas and not events and not records and stats == self._last_stats:
            return
        self._last_stats = stats
        message = StepOutputs(deltas=deltas, stats=stats, adapter_events=events, source_records=records)
        self._outputs.send(encode(message))


def _take_all(items: list) -> list:
    """Move everything out of a list other threads append to, losing nothing appended meanwhile."""
    count = len(items)
    taken = items[:count]
    del items[:count]  # one operation under the interpreter lock: later appends stay
    return taken
