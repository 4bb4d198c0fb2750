"""Read timeouts for slow clients: headers within a deadline, bodies at a minimum rate (uvicorn has neither).

Without them a client that opens connections and sends a header line a minute, or a body a byte at a
time, holds each connection (and the request handler waiting for its body) for as long as it likes.
The rule is Apache's mod_reqtimeout's: a request's headers must be complete within
`header_timeout_s` of its first byte (or of the connection opening); its body gets `body_timeout_s`,
extended by one second for every `body_min_rate` bytes received, so large uploads at a reasonable rate
always finish while a trickle does not. Time during which the server itself stopped reading (the
handler is busy with what it already has: uvicorn's flow control) or has not yet asked for a body the
client holds back (`Expect: 100-continue`) is not held against the client.
A client past its deadline gets 408 with OpenAI's error body, when no response has started, and the
connection is closed.

The settings are `--http-header-timeout`, `--http-body-timeout` and `--http-body-min-rate`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 20.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_MIN_RATE = 16384  # bytes per second
_HEADERS, _BODY, _IDLE = "headers", "body", "idle"


def bounded_h11_protocol(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    body_min_rate: float = DEFAULT_BODY_MIN_RATE,
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these read deadlines (pass it as `uvicorn.Config(http=...)`)."""
    for name, value in (
        ("header timeout", header_timeout_s),
        ("body timeout", body_timeout_s),
        ("body min rate", body_min_rate),
    ):
        if not value > 0:
            raise ValueError(f"the HTTP {name} must be positive (got {value})")
    return type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "body_min_rate": body_min_rate,
        },
    )


class BoundedH11Protocol(H11Protocol):
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s = DEFAULT_BODY_TIMEOUT_S
    body_min_rate: float = DEFAULT_BODY_MIN_RATE

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase = _IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._body_start = 0.0
        self._body_bytes = 0
        super().connection_made(transport)
        self._start_headers()  # a connection that never sends a byte is held to the header deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel()
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # the request line and headers are not complete yet
            if self._phase != _HEADERS:
                self._start_headers()
        elif state is h11.SEND_BODY:
            if self._phase != _BODY:
                self._phase, self._body_start, self._body_bytes = _BODY, time.monotonic(), 0
            self._body_bytes += len(data)
            self._arm(self._body_deadline())
        else:  # the client sent the whole request (or closed): nothing more is read for it
            self._phase = _IDLE
            self._cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self._phase != _IDLE:
            self._phase = _IDLE  # keep-alive: uvicorn's own idle timeout runs until the next request's bytes
            self._cancel()

    # -- deadlines --------------------------------------------------------------------------------

    def _start_headers(self) -> None:
        self._phase = _HEADERS
        self._arm(time.monotonic() + self.header_timeout_s)

    def _body_deadline(self) -> float:
        return self._body_start + self.body_timeout_s + self._body_bytes / self.body_min_rate

    def _arm(self, deadline: float) -> None:
        self._cancel()
        self._timer = self.loop.call_later(max(0.0, deadline - time.monotonic()), self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        waiting_for_us = self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue)
        if self._phase == _BODY and waiting_for_us:
            # The handler has not taken what arrived yet, or not yet asked for the body the client holds
            # back until "100 Continue": the server is the slow one. A fresh allowance.
            self._body_start, self._body_bytes = time.monotonic(), 0
            self._arm(self._body_deadline())
            return
        what = "its headers" if self._phase == _HEADERS else "its body"
        log.info("closing a connection from %s: %s arrived too slowly", _peer(self.client), what)
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response(what))
        self.transport.close()  # the handler, if one runs, sees the client as gone


def _timeout_response(what: str) -> bytes:
    """408 with OpenAI's error body, written straight to the socket (h11 allows no response before the
    request is complete) with `Connection: close`."""
    message = f"the request was not received in time: {what} arrived too slowly; send it at a steady rate"
    body = msgspec.json.encode(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": "request_timeout",
                "param": None,
            }
        }
    )
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    return head + body


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown client"
