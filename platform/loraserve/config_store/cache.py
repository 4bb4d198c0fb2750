"""The server's view of the config store: an in-memory cache that survives backend outages.

Reads come from memory. A change event marks the matching entries stale; the next read refreshes
them. Entries are never dropped for being stale, only replaced, so when the backend is unreachable a
read serves the last known value instead of failing. Failures show in `healthy`, `last_error` and
`unhealthy_since` (for /ready and metrics); a probe pings the backend with exponential backoff until it
answers again.

Two counters keep a slow refresh from resurrecting old data:

    generation  bumped by every invalidation; a load that overlapped one is stored, but as stale
    epoch       bumped by resync/disconnect/recovery; every entry of an older epoch is stale

While the event stream is down (`disconnected`), loaded entries are stored stale too: nothing would
tell us when they change, so each read goes to the backend, and falls back to the cache if that fails.
A cache miss during an outage raises ConfigStoreUnavailable (nothing to serve). Unknown keys and
missing routes are cached as None as well, so probing random keys cannot hammer the backend; the LRU
bound caps the memory that costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from typing import Any, Literal

from loraserve.config_store.base import ConfigStore
from loraserve.config_store.errors import ConfigStoreUnavailable
from loraserve.config_store.events import ConfigEvent, EventCallback, Subscribers
from loraserve.routing.route import Route
from loraserve.tenancy.keys import ApiKey

log = logging.getLogger(__name__)


class _Entry:
    __slots__ = ("value", "fresh", "epoch")

    def __init__(self, value: Any, fresh: bool, epoch: int) -> None:
        self.value = value
        self.fresh = fresh
        self.epoch = epoch


class CachedConfigStore(ConfigStore):
    def __init__(
        self,
        backend: ConfigStore,
        *,
        max_entries: int = 100_000,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 5.0,
    ) -> None:
        self.backend = backend
        self._max_entries = max_entries
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._generation = 0
        self._epoch = 0
        self._inflight: dict[Hashable, asyncio.Task[Any]] = {}
        self._read_error: str | None = None  # the last backend call failed; set until a call or ping succeeds
        self._listen_error: str | None = None  # the change stream is down; set until the next resync
        self._unhealthy_since: float | None = None
        self._probe: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._subscribers = Subscribers()

    async def start(self) -> CachedConfigStore:
        """Subscribe to the backend's change events; call once before serving."""
        if self._unsubscribe is None:
            self._unsubscribe = await self.backend.subscribe(self._on_event)
        return self

    async def __aenter__(self) -> CachedConfigStore:
        return await self.start()

    # health

    @property
    def healthy(self) -> bool:
        return self._read_error is None and self._listen_error is None

    @property
    def last_error(self) -> str | None:
        return self._listen_error or self._read_error

    @property
    def unhealthy_since(self) -> float | None:
        """Unix time of the first failure of the current outage; None while healthy."""
        return self._unhealthy_since

    # reads

    async def get_route(self, tenant: str, name: str) -> Route | None:
        return await self._read(("route", tenant, name), lambda: self.backend.get_route(tenant, name))

    async def list_routes(self, tenant: str) -> list[Route]:
        return list(await self._read(("routes", tenant), lambda: self.backend.list_routes(tenant)))

    async def get_key(self, key_hash: str) -> ApiKey | None:
        return await self._read(("key", key_hash), lambda: self.backend.get_key(key_hash))

    async def list_keys(self) -> list[ApiKey]:
        return list(await self._read(("keys",), self.backend.list_keys))

    # writes: straight to the backend, then drop this replica's copies at once (read-your-writes)

    async def put_route(self, tenant: str, route: Route) -> None:
        await self._call(self.backend.put_route(tenant, route))
        self._invalidate(("route", tenant, route.name), ("routes", tenant))

    async def put_route_checked(
        self, tenant: str, route: Route, check: Callable[[list[str]], Awaitable[None]]
    ) -> None:
        """The backend's, which reads what it checks from the backend itself, never from this cache."""
        await self._call(self.backend.put_route_checked(tenant, route, check))
        self._invalidate(("route", tenant, route.name), ("routes", tenant))

    @asynccontextmanager
    async def adapter_deletion(
        self, tenant: str, name: str
    ) -> AsyncIterator[Callable[[], Awaitable[list[Route]]]]:
        """The backend's; the routes it yields are read from the backend, never from this cache."""
        try:
            async with self.backend.adapter_deletion(tenant, name) as routes:
                yield lambda: self._call(routes())
        except ConfigStoreUnavailable as exc:
            self._failed(str(exc))
            raise

    async def delete_route(self, tenant: str, name: str) -> bool:
        deleted = await self._call(self.backend.delete_route(tenant, name))
        self._invalidate(("route", tenant, name), ("routes", tenant))
        return deleted

    async def put_key(self, key: ApiKey) -> None:
        await self._call(self.backend.put_key(key))
        self._invalidate(("key", key.key_hash), ("keys",))

    async def delete_key(self, key_hash: str) -> bool:
        deleted = await self._call(self.backend.delete_key(key_hash))
        self._invalidate(("key", key_hash), ("keys",))
        return deleted

    async def announce_adapter_change(self, tenant: str, name: str, op: Literal["put", "delete"]) -> None:
        await self._call(self.backend.announce_adapter_change(tenant, name, op))

    # events and lifecycle

    async def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Backend events, delivered after this cache has applied them."""
        return self._subscribers.add(callback)

    async def ping(self) -> None:
        await self._call(self.backend.ping())

    async def close(self) -> None:
        for task in [self._probe, *self._inflight.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._probe = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        await self.backend.close()

    # internals

    async def _read(self, key: Hashable, load: Callable[[], Awaitable[Any]]) -> Any:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            # During a known outage (probe running) the last known value is the answer; no backend wait.
            if (entry.fresh and entry.epoch == self._epoch) or self._read_error is not None:
                return entry.value
        task = self._inflight.get(key)
        if task is None:  # concurrent readers of one stale key share a single backend call
            task = asyncio.create_task(self._load(key, load))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._load_done, key))
        try:
            return await asyncio.shield(task)
        except ConfigStoreUnavailable:
            if entry is not None:
                return entry.value
            raise

    async def _load(self, key: Hashable, load: Callable[[], Awaitable[Any]]) -> Any:
        generation, epoch = self._generation, self._epoch
        trusted = self._listen_error is None
        value = await self._call(load())
        fresh = trusted and generation == self._generation and epoch == self._epoch
        self._entries[key] = _Entry(value, fresh, self._epoch)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return value

    def _load_done(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: the awaiting readers got it (or fell back to the cache)

    async def _call(self, awaitable: Awaitable[Any]) -> Any:
        try:
            result = await awaitable
        except ConfigStoreUnavailable as exc:
            self._failed(str(exc))
            raise
        if self._read_error is not None:
            log.info("config store reachable again")
            self._read_error = None
            self._invalidate_all()  # served stale during the outage: refresh everything on next read
            self._update_since()
        return result

    def _failed(self, reason: str) -> None:
        if self._read_error is None:
            log.warning("config store failing, serving the last known config: %s", reason)
        self._read_error = reason
        self._update_since()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_back(), name="config-store-probe")

    async def _probe_until_back(self) -> None:
        delay = self._retry_initial_s
        while self._read_error is not None:
            await asyncio.sleep(delay)
            with contextlib.suppress(ConfigStoreUnavailable):
                await self._call(self.backend.ping())
            delay = min(delay * 2, self._retry_max_s)

    def _on_event(self, event: ConfigEvent) -> None:
        if event.kind == "route":
            self._invalidate(("route", event.tenant, event.name), ("routes", event.tenant))
        elif event.kind == "key":
            self._invalidate(("key", event.name), ("keys",))
        elif event.kind == "resync":
            self._listen_error = None
            self._invalidate_all()
        elif event.kind == "disconnected":
            self._listen_error = event.error or "config change stream disconnected"
            self._invalidate_all()
        self._update_since()
        self._subscribers.emit(event)

    def _invalidate(self, *keys: Hashable) -> None:
        self._generation += 1
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.fresh = False

    def _invalidate_all(self) -> None:
        self._generation += 1
        self._epoch += 1

    def _update_since(self) -> None:
        if self.healthy:
            self._unhealthy_since = None
        elif self._unhealthy_since is None:
            self._unhealthy_since = time.time()
