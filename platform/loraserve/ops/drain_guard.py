"""Requests with a body (uploads above all) end with the 503 body on SIGTERM, never a cut connection.

The drain (ops/shutdown.py) waits for every request this middleware tracks, from its first byte of body
to its last byte of response. Past the drain's deadline, a request still receiving its body has its next
read raise `ServiceUnavailable`, which the error table turns into the 503 body (`server_shutting_down`);
one whose handler is still working when uvicorn finally cancels it gets the same body instead of
uvicorn's plain-text 500, if its response has not started.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from loraserve.errors import ErrorBody, ErrorDetail, ServiceUnavailable, error_type
from loraserve.ops.shutdown import Shutdown

log = logging.getLogger(__name__)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_MESSAGE = "the server is shutting down and stopped this request; retry it on another replica"
_CODE = "server_shutting_down"


class _TrackedRequest:
    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.body_done = False

    async def abort_for_shutdown(self) -> None:
        self.stop.set()


def drain_guard(shutdown: Shutdown):
    """Litestar middleware (an ASGI app factory) for the app's drain state."""

    def middleware(app: Any) -> Any:
        async def guarded(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
                await app(scope, receive, send)
                return
            request = _TrackedRequest()
            started = False

            async def guarded_receive() -> dict:
                if request.body_done:
                    return await receive()
                message = await _unless_stopped(receive(), request.stop)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    request.body_done = True
                return message

            async def tracked_send(message: dict) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            shutdown.track_request(request)
            try:
                await app(scope, guarded_receive, tracked_send)
            except asyncio.CancelledError:  # uvicorn gave up waiting for it at exit
                if not started:
                    await _send_unavailable(send)
                raise
            finally:
                shutdown.untrack_request(request)

        return guarded

    return middleware


async def _unless_stopped(receiving: Any, stop: asyncio.Event) -> dict:
    """The next body message, or ServiceUnavailable if the drain stops the request first."""
    if stop.is_set():
        receiving.close()
        raise ServiceUnavailable(_MESSAGE, code=_CODE)
    message = asyncio.ensure_future(receiving)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({message, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if message.done():
        return message.result()
    message.cancel()
    raise ServiceUnavailable(_MESSAGE, code=_CODE)


async def _send_unavailable(send: Any) -> None:
    detail = ErrorDetail(message=_MESSAGE, type=error_type(503), code=_CODE)
    body = msgspec.json.encode(ErrorBody(error=detail))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    try:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # the connection is gone already: nobody to tell
        log.debug("could not send the shutdown 503", exc_info=True)
