"""A short-lived cache of adapter lookups (`name` or `name@version` -> record) in front of the store.

Every request whose `model` is an adapter asks the store which version it means; on S3 that is a
LIST and a GET. Answers (found or not) are kept for `ttl_s` (half a second), so a burst of requests
costs one store call, while an upload or a delete made through another replica is still seen within
a second. Uploads and deletes through this replica invalidate at once. Concurrent misses of one key
share a single store call, run in a worker thread so the event loop never waits on boto3 or the disk.

Lives outside `loraserve.resolution` because `Services` holds one, and resolution imports Services.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from adapters_store import AdapterNotFound, AdapterRecord, AdapterStore, parse_ref

CacheKey = tuple[str, str, int | None]  # (tenant, name, version or None for the latest)


class AdapterLookup:
    def __init__(
        self, ttl_s: float = 0.5, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        # key -> (expires_at, record, or the not-found message)
        self._entries: OrderedDict[CacheKey, tuple[float, AdapterRecord | str]] = OrderedDict()
        self._inflight: dict[CacheKey, asyncio.Future[AdapterRecord | str]] = {}
        self._generation = 0  # bumped by invalidate(): a lookup that overlapped one is not cached

    async def resolve(self, store: AdapterStore, tenant: str, ref: str) -> AdapterRecord:
        """The record `ref` names now; AdapterNotFound (or the store's InvalidName) otherwise."""
        name, version = parse_ref(ref)
        key = (tenant, name, version)
        cached = self._entries.get(key)
        if cached is not None and cached[0] > self._clock():
            return _answer(cached[1])
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(self._load(store, key))
            self._inflight[key] = future
            future.add_done_callback(lambda done: self._load_done(key, done))
        return _answer(await asyncio.shield(future))

    def invalidate(self, tenant: str, name: str) -> None:
        """Forget every cached answer about one adapter (after an upload or delete through this replica)."""
        self._generation += 1
        for key in [k for k in self._entries if k[:2] == (tenant, name)]:
            del self._entries[key]

    def _load_done(self, key: CacheKey, future: asyncio.Future[AdapterRecord | str]) -> None:
        if self._inflight.get(key) is future:
            del self._inflight[key]
        if not future.cancelled():
            future.exception()  # retrieved: its waiters got it (or were cancelled and no longer care)

    async def _load(self, store: AdapterStore, key: CacheKey) -> AdapterRecord | str:
        tenant, name, version = key
        generation = self._generation
        try:
            answer: AdapterRecord | str = await asyncio.to_thread(store.get, tenant, name, version)
        except AdapterNotFound as exc:
            answer = exc.message
        if generation == self._generation:
            self._entries[key] = (self._clock() + self.ttl_s, answer)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return answer


def _answer(answer: AdapterRecord | str) -> AdapterRecord:
    if isinstance(answer, str):
        raise AdapterNotFound(answer)  # a fresh exception each time: tracebacks must not pile up
    return answer
