"""Change events and the callback list that delivers them.

`route` and `key` events name what changed, so caches drop only that; `adapter` events (an upload or a
delete through some replica) do the same for the adapter lookups in front of the adapter store, which
announces nothing itself. `resync` means events may have
been missed (the subscription was just made or remade): drop everything. `disconnected` means the
event stream is down, so cached copies may silently go stale until the next `resync`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import msgspec

log = logging.getLogger(__name__)

EventKind = Literal["route", "key", "adapter", "resync", "disconnected"]


class ConfigEvent(msgspec.Struct, frozen=True, kw_only=True):
    kind: EventKind
    op: Literal["put", "delete"] | None = None
    tenant: str | None = None  # route and adapter events only
    name: str | None = None  # the route or adapter name, or the key hash for key events
    error: str | None = None  # disconnected events only: why


EventCallback = Callable[[ConfigEvent], None]


class Subscribers:
    """Callbacks run in the order added; one that raises is logged and never stops the others."""

    def __init__(self) -> None:
        self._callbacks: list[EventCallback] = []

    def add(self, callback: EventCallback) -> Callable[[], None]:
        self._callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unsubscribe

    def emit(self, event: ConfigEvent) -> None:
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception:
                log.exception("config change callback %r failed on %s", callback, event)
