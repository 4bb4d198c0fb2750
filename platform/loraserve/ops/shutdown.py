"""Graceful shutdown: stop admitting, let running requests finish, then stop the rest cleanly.

On SIGTERM the CLI calls `drain()`: from then on new inference requests get 503 and /ready says 503
(load balancers take the replica out), running requests get `timeout_s` to finish, and whatever is
left is aborted in the engine, so each stream ends with an error event and `data: [DONE]` instead of
a cut connection. Requests still receiving their bodies (uploads) are tracked too (ops/drain_guard.py):
past the deadline they get the 503 body rather than a cut connection. Only then does the server stop
listening.

`fail(reason)` is the other way out: the engine core died, so nothing can be served; the CLI stops
the server at once and exits non-zero (a supervisor or Kubernetes starts a fresh one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

log = logging.getLogger(__name__)

_POLL_S = 0.05
_FINAL_EVENT_GRACE_S = 5.0  # time the aborted streams get to write their last event


class Drainable(Protocol):
    async def abort_for_shutdown(self) -> None: ...


class Shutdown:
    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.fatal_error: str | None = None  # set (from any thread) when the server must exit non-zero
        self._active: set[Drainable] = set()  # generations
        self._requests: set[Drainable] = set()  # requests with a body, until their response is sent
        self._aborted: set[int] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    @property
    def in_flight(self) -> tuple[Drainable, ...]:
        return tuple(self._active)

    def fail(self, reason: str) -> None:
        """The server cannot serve any more: stop admitting; the CLI exits non-zero. Any thread."""
        self.draining = True
        if self.fatal_error is None:
            self.fatal_error = reason

    def track(self, item: Drainable) -> None:
        self._active.add(item)

    def untrack(self, item: Drainable) -> None:
        self._active.discard(item)
        self._aborted.discard(id(item))

    def track_request(self, item: Drainable) -> None:
        self._requests.add(item)

    def untrack_request(self, item: Drainable) -> None:
        self._requests.discard(item)
        self._aborted.discard(id(item))

    def aborted(self, item: Drainable) -> bool:
        """True when the drain stopped this request (its engine abort is not the client's doing)."""
        return id(item) in self._aborted

    async def drain(self, timeout_s: float | None = None) -> int:
        """Stop admitting, wait for in-flight requests, abort the rest; returns how many were aborted."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.draining = True
        log.info(
            "draining: %d generation(s) and %d request(s) in flight, up to %.0f s to finish",
            len(self._active),
            len(self._requests),
            timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while (self._active or self._requests) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        leftover = list(self._active)
        if leftover or self._requests:
            log.warning(
                "shutdown timeout reached: aborting %d generation(s) and %d request(s)",
                len(leftover),
                len(self._requests),
            )
        for item in leftover + list(self._requests):
            self._aborted.add(id(item))
            await item.abort_for_shutdown()
        grace = time.monotonic() + _FINAL_EVENT_GRACE_S
        while (self._active or self._requests) and time.monotonic() < grace:
            await asyncio.sleep(_POLL_S)
        return len(leftover)
