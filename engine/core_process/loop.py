"""The engine core's busy loop: take inputs, schedule -> execute -> update (EngineCore.core_step), send
its token deltas as they are.

The loop blocks on its sockets only while it has nothing to run; while requests run it only drains what
has arrived and steps again. It serves one or several front ends ("clients";
engine.core_process.clients): each request belongs to the client that added it, and each step sends every client one StepOutputs holding
its own requests' deltas, the step's stats snapshot (encoded once for all), and, for one client only,
the adapter events. One request's bad data fails that request alone (AddRequest errors become a failed
RequestDelta); an exception out of `EngineCore.core_step` is an engine bug and ends the loop (the process
reports it and exits).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from engine.core.request_checks import RequestError
from engine.core.step_outputs import refused_delta
from engine.core_process.clients import Clients
from engine.engine_core import EngineCore
from engine.messages import (
    AbortRequests,
    AdapterEvent,
    AddRequest,
    ClientGone,
    ClientHello,
    CoreReady,
    ForgetAdapter,
    PreloadAdapters,
    RequestDelta,
    ShutdownCore,
    UnpinAdapters,
    decode_input,
    encode,
)

logger = logging.getLogger(__name__)

# How long an idle core waits for input before it looks at its adapter loads and stats again.
IDLE_POLL_MS = 50


class EngineCoreLoop:
    """Runs one EngineCore behind an input and an output ROUTER socket."""

    def __init__(
        self, engine: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, adapter_events: list[AdapterEvent]
    ):
        self.engine = engine
        self._inputs = inputs
        self._outputs = outputs
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)
        self._poller.register(outputs, zmq.POLLIN)  # hellos of clients that connect later
        # Appended to by the adapter manager's observer (engine and loader threads); drained per message.
        self._adapter_events = adapter_events
        self._drain_source = getattr(engine.lora.source, "drain", None)
        self.clients = Clients(outputs, on_gone=self._client_gone)
        # Requests refused on arrival, sent to the client that sent them with the next message.
        self._failed: list[tuple[bytes, RequestDelta]] = []
        self._stopping = False

    def run(self) -> None:
        """Serve until a ShutdownCore message arrives."""
        while not self._stopping:
            busy = self.engine.has_unfinished_requests()
            self._receive(0 if busy else IDLE_POLL_MS)
            if self._stopping:
                return
            if self.engine.has_unfinished_requests():
                deltas = self.engine.core_step()
            else:
                self.engine.advance_adapters()  # preloads land while idle
                deltas = []
            self._send(deltas)

    # -- inputs -----------------------------------------------------------------------------------

    def _receive(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout_ms))
        if not events:
            return
        if self._outputs in events:
            self._receive_hellos()
        while not self._stopping:
            try:
                client, *frames = self._inputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            for data in frames:  # one frame per message; a client sends related ones together
                try:
                    message = decode_input(data)
                except msgspec.ValidationError as exc:
                    self._refuse_undecodable(client, data, exc)
                    continue
                self._handle(client, message)

    def _receive_hellos(self) -> None:
        """Clients announce their output route (ClientHello); each gets CoreReady once."""
        while True:
            try:
                client, data = self._outputs.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:  # a hello without payload: malformed, ignore
                continue
            try:
                message = decode_input(data)
            except msgspec.ValidationError:
                message = None
            if not isinstance(message, ClientHello):
                logger.error("dropped a message on the output socket that is not a ClientHello")
                continue
            ready = CoreReady(self.engine.max_model_len, list(self.engine.eos_token_ids), self.engine.stats())
            self.clients.join(client, encode(ready))

    def _handle(self, client: bytes, message) -> None:
        if isinstance(message, AddRequest):
            self._add(client, message)
        elif isinstance(message, AbortRequests):
            self.engine.abort_core_requests(self.clients.owned_by(client, message.request_ids))
        elif isinstance(message, ForgetAdapter):
            self.engine.forget_adapter(message.adapter_id)
        elif isinstance(message, PreloadAdapters):
            self.engine.preload_adapters(message.adapter_ids, message.level, message.pin)
        elif isinstance(message, UnpinAdapters):
            self.engine.unpin_adapters(message.adapter_ids, message.unload)
        elif isinstance(message, ClientGone):
            self.clients.leave(message.client_id.encode(), "its process died")
        elif isinstance(message, ShutdownCore):
            self._stopping = True

    def _add(self, client: bytes, message: AddRequest) -> None:
        if not self.clients.own(message.request_id, client):
            self._refuse(client, message.request_id, f"request id {message.request_id!r} is already in use")
            return
        try:
            self.engine.add_core_request(message)
        except ValueError as exc:  # this request's data (params, a duplicate id): fail it, keep serving
            self._refuse(
                client, message.request_id, str(exc), exc.code if isinstance(exc, RequestError) else None
            )
            return
        except Exception as exc:  # a bug met by this request's data: still this request alone
            logger.exception("adding request %s failed", message.request_id)
            self._refuse(client, message.request_id, f"the request could not start: {exc}")
            return

    def _refuse_undecodable(self, client: bytes, data: bytes, error: Exception) -> None:
        """A message that does not decode (e.g. params its __post_init__ refuses): fail its request if it
        names one; anything else is a front-end bug, logged and dropped."""
        raw = msgspec.msgpack.decode(data)
        request_id = raw.get("request_id") if isinstance(raw, dict) and raw.get("type") == "add" else None
        if isinstance(request_id, str):
            self._refuse(client, request_id, f"invalid request: {error}", RequestError.code)  # its own data
        else:
            logger.error("dropped an input message that does not decode: %s", error)

    def _refuse(self, client: bytes, request_id: str, reason: str, error_code: str | None = None) -> None:
        logger.warning("request %s refused: %s", request_id, reason)
        self._failed.append((client, refused_delta(request_id, reason, error_code)))

    def _client_gone(self, request_ids: list[str]) -> None:
        """A client's process is gone: nobody reads its requests any more; free them."""
        if request_ids:
            self.engine.abort_core_requests(request_ids)

    # -- outputs ----------------------------------------------------------------------------------

    def _send(self, deltas: list[RequestDelta]) -> None:
        refused, self._failed = self._failed, []
        events = _take_all(self._adapter_events)
        records = self._drain_source() if self._drain_source is not None else []
        self.clients.send_step(deltas, self.engine.stats(), events, records, refused)


def _take_all(items: list) -> list:
    """Move everything out of a list other threads append to, losing nothing appended meanwhile."""
    count = len(items)
    taken = items[:count]
    del items[:count]  # one operation under the interpreter lock: later appends stay
    return taken
