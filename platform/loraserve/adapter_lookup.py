"""What model resolution needs from the adapter store (`name` or `name@version` -> record), cached.

Every request whose `model` is an adapter needs the version it means; asking the store each time costs
a LIST and a GET on S3 (a directory walk on the local store), and makes every request fail or hang
with the store. So answers (found or not) are kept, and:

- fresh for `ttl_s`; uploads and deletes announce themselves as config events (through Redis to every
  replica), which drop that adapter's answers at once, so the TTL only bounds what a lost event costs;
- past the TTL, an answer whose adapter is resident in the engine (GPU slot or CPU tier) is served as
  it is while a background refresh asks the store: a request for a resident adapter never waits on it;
- any other answer is refreshed before use, but at most `timeout_s` is spent waiting; when the store
  fails or is too slow, the last known answer is served (stale-if-error), and a name never seen gets
  StoreUnavailable (503);
- after a failure the store is left alone for `retry_s`: meanwhile known answers are served and
  unknown names fail at once instead of each waiting `timeout_s` for a store that is down.

Store calls run on a small pool of their own, so a hung store cannot take the threads that the rest of
the server uses; concurrent misses of one key share one call.

Lives outside `loraserve.resolution` because `Services` holds one, and resolution imports Services.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from adapters_store import AdapterNotFound, AdapterRecord, AdapterStore, StoreUnavailable, parse_ref

log = logging.getLogger(__name__)

T = TypeVar("T")
CacheKey = tuple[str, str, int | None]  # (tenant, name, version or None for the latest)
Answer = AdapterRecord | str  # the record, or the not-found message
IsResident = Callable[[str, AdapterRecord], bool]  # (tenant, record) -> in a GPU slot or the CPU tier

DEFAULT_TTL_S = 30.0
DEFAULT_TIMEOUT_S = 5.0
STORE_UNAVAILABLE = "the adapter store is unavailable; retry later"


@dataclass
class _Entry:
    answer: Answer
    check_at: float  # monotonic time after which the store is asked again
    valid: bool = True  # False: an event said it changed, refresh before use (stale-if-error still)


class AdapterLookup:
    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_s: float = 2.0,
        max_entries: int = 10_000,
        max_workers: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0 or timeout_s <= 0 or retry_s < 0:
            raise ValueError(
                f"ttl_s and retry_s must be >= 0 and timeout_s > 0 (got {ttl_s}, {timeout_s}, {retry_s})"
            )
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._max_entries = max_entries
        self._max_workers = max_workers
        self._clock = clock
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._inflight: dict[CacheKey, asyncio.Future[Answer]] = {}
        self._generation = 0  # bumped by every invalidation: a load that overlapped one is not trusted
        self._store_down_until = -float("inf")
        self.store_up = True  # False from a failed or timed-out store call until one succeeds
        self._executor: ThreadPoolExecutor | None = None
        # Answers served past their TTL: resident adapters while a refresh runs, any known one while the
        # store fails or is slow.
        self.num_stale_served = 0

    async def resolve(
        self, store: AdapterStore, tenant: str, ref: str, is_resident: IsResident | None = None
    ) -> AdapterRecord:
        """The record `ref` names; AdapterNotFound, the store's InvalidName, or StoreUnavailable."""
        name, version = parse_ref(ref)
        key = (tenant, name, version)
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            if entry.valid and now < entry.check_at:
                return _answer(entry.answer)
            resident = isinstance(entry.answer, AdapterRecord) and is_resident is not None
            if entry.valid and resident and is_resident(tenant, entry.answer):
                if now >= self._store_down_until:
                    self._load_shared(store, key)  # refresh in the background; this request goes on now
                self.num_stale_served += 1
                return _answer(entry.answer)
            if now < self._store_down_until:
                self.num_stale_served += 1
                return _answer(entry.answer)
        elif now < self._store_down_until:
            raise StoreUnavailable(STORE_UNAVAILABLE)
        try:
            return _answer(
                await asyncio.wait_for(asyncio.shield(self._load_shared(store, key)), self.timeout_s)
            )
        except (StoreUnavailable, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                self._store_failed(f"no answer within {self.timeout_s:g} s")
            if entry is None:
                raise StoreUnavailable(STORE_UNAVAILABLE) from None
            self.num_stale_served += 1
            return _answer(entry.answer)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run another store read (a listing) on the lookup pool, waiting at most `timeout_s`."""
        if self._clock() < self._store_down_until:
            raise StoreUnavailable(STORE_UNAVAILABLE)
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(loop.run_in_executor(self._pool(), fn, *args), self.timeout_s)
        except TimeoutError:
            self._store_failed(f"no answer within {self.timeout_s:g} s")
            raise StoreUnavailable(STORE_UNAVAILABLE) from None
        except StoreUnavailable as exc:
            self._store_failed(exc.reason)
            raise
        self.store_up = True
        return result

    def invalidate(self, tenant: str, name: str, *, deleted: bool = False) -> None:
        """One adapter changed: refresh its answers before use; after a delete, forget them outright."""
        self._generation += 1
        for key in [k for k in self._entries if k[:2] == (tenant, name)]:
            if deleted:
                del self._entries[key]
            else:
                self._entries[key].valid = False

    def expire_all(self) -> None:
        """Changes may have been missed (the event stream reconnected): check every answer again."""
        self._generation += 1
        for entry in self._entries.values():
            entry.check_at = -float("inf")

    def on_config_event(self, event: Any) -> None:
        """A config-store subscriber: adapter events invalidate, a resync expires everything."""
        if event.kind == "adapter" and event.tenant and event.name:
            self.invalidate(event.tenant, event.name, deleted=event.op == "delete")
        elif event.kind == "resync":
            self.expire_all()

    def close(self) -> None:
        """Stop the pool without waiting for calls still blocked on the store (their timeouts end them)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # internals

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="adapter-lookup")
        return self._executor

    def _load_shared(self, store: AdapterStore, key: CacheKey) -> asyncio.Future[Answer]:
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(self._load(store, key))
            self._inflight[key] = future
            future.add_done_callback(lambda done: self._load_done(key, done))
        return future

    def _load_done(self, key: CacheKey, future: asyncio.Future[Answer]) -> None:
        if self._inflight.get(key) is future:
            del self._inflight[key]
        if not future.cancelled():
            future.exception()  # retrieved: its waiters got it, or were served the last known answer

    async def _load(self, store: AdapterStore, key: CacheKey) -> Answer:
        tenant, name, version = key
        generation = self._generation
        loop = asyncio.get_running_loop()
        try:
            answer: Answer = await loop.run_in_executor(self._pool(), store.get, tenant, name, version)
        except AdapterNotFound as exc:
            answer = exc.message
        except StoreUnavailable as exc:
            self._store_failed(exc.reason)  # the entry stays: served while the store is down
            raise
        self._store_down_until = -float("inf")
        self.store_up = True
        if generation == self._generation:
            self._put(key, answer)
            if version is None and isinstance(answer, AdapterRecord):
                self._put((tenant, name, answer.version), answer)  # `name` told us `name@version` too
        return answer

    def _put(self, key: CacheKey, answer: Answer) -> None:
        self._entries[key] = _Entry(answer, self._clock() + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def _store_failed(self, reason: str) -> None:
        if self.store_up:
            log.warning("adapter store failing (%s); serving adapter lookups from the cache", reason)
        self.store_up = False
        self._store_down_until = self._clock() + self.retry_s


def _answer(answer: Answer) -> AdapterRecord:
    if isinstance(answer, str):
        raise AdapterNotFound(answer)  # a fresh exception each time: tracebacks must not pile up
    return answer
