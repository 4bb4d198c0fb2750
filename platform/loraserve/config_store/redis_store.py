"""The shared config store for replicas: Redis hashes plus a change channel.

    {prefix}:routes:{tenant}   hash  route name -> Route JSON
    {prefix}:keys              hash  sha256 hex -> ApiKey JSON
    {prefix}:deleting:{tenant} hash  "adapter token" -> unix time the mark expires (deletions in progress)
    {prefix}:config            channel of ConfigEvent JSON

Every write and its event go out in one MULTI/EXEC, so a change is never stored without being
announced. A listener task (started by the first `subscribe`) turns channel messages into callbacks;
each time it (re)subscribes it emits `resync`, because events published while it was away are lost,
and when the connection drops it emits `disconnected` and retries with exponential backoff.

Route writes and adapter deletions exclude each other across replicas (ConfigStore.put_route_checked,
adapter_deletion): a deletion first marks its adapter in `deleting:{tenant}`, then reads the routes; a
checked route write WATCHes that hash and the tenant's routes, waits while a mark names one of its
adapters, runs its check (the adapters' existence, the quota) and writes in MULTI/EXEC, which fails and
retries if a mark or a route changed meanwhile. So either the write lands before the mark, and the
deletion sees the route, or the mark comes first, and the write waits for the deletion to end (then its
check finds the version gone). A mark expires after DELETION_MARK_TTL_S, should its replica die.

Timeouts are short and retries few on purpose: a request must not hang on Redis when the cache
already holds the answer (CachedConfigStore serves the last known config while this one fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

import msgspec
import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError, WatchError

from adapter_format.names import check_route_name, check_tenant, is_valid_name
from loraserve.config_store.base import ConfigStore
from loraserve.config_store.errors import AdapterBeingDeleted, ConfigStoreError, ConfigStoreUnavailable
from loraserve.config_store.events import ConfigEvent, EventCallback, Subscribers
from loraserve.routing.route import Route, parse_adapter_ref
from loraserve.tenancy.keys import ApiKey, is_key_hash

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "loraserve"
T = TypeVar("T")
# A deletion's mark outlives any deletion (a tombstone write per version), so it only matters when the
# replica holding it died; route writes naming that adapter wait at most ROUTE_WRITE_WAIT_S, then 409.
DELETION_MARK_TTL_S = 120.0
ROUTE_WRITE_WAIT_S = 10.0


class RedisConfigStore(ConfigStore):
    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        connect_timeout_s: float = 1.0,
        timeout_s: float = 2.0,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 5.0,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.channel = f"{prefix}:config"
        self._where = redact_url(url)
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        # One quick retry covers a pooled connection that died with a Redis restart; more would stall requests.
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1),
            health_check_interval=5,
        )
        self._subscribers = Subscribers()
        self._listener: asyncio.Task[None] | None = None
        self._first_attempt = asyncio.Event()
        self.listening = False  # True while the channel subscription is live

    def __repr__(self) -> str:
        return f"RedisConfigStore({self._where!r}, prefix={self.prefix!r})"

    # routes

    async def get_route(self, tenant: str, name: str) -> Route | None:
        if not (is_valid_name(tenant) and is_valid_name(name)):
            return None  # nothing can be stored under such a name (model ids like "org/model" land here)
        raw = await self._call(self._client.hget(self._routes_key(tenant), name))
        return _decode(raw, Route, f"route {tenant}/{name}")

    async def put_route(self, tenant: str, route: Route) -> None:
        event = ConfigEvent(kind="route", op="put", tenant=tenant, name=route.name)
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self._routes_key(tenant), check_route_name(route.name), msgspec.json.encode(route))
        pipe.publish(self.channel, msgspec.json.encode(event))
        await self._call(pipe.execute())

    async def put_route_checked(
        self, tenant: str, route: Route, check: Callable[[list[str]], Awaitable[None]]
    ) -> None:
        adapters = {parse_adapter_ref(ref).name for variant in route.variants for ref in variant.adapter_refs}
        routes_key, deleting_key = self._routes_key(tenant), self._deleting_key(tenant)
        event = ConfigEvent(kind="route", op="put", tenant=tenant, name=route.name)
        deadline = time.monotonic() + ROUTE_WRITE_WAIT_S
        async with self._tenant_lock(tenant):  # this replica's writers queue here, not in WATCH retries
            while True:
                blocked = None
                try:
                    async with self._client.pipeline(transaction=True) as pipe:
                        await pipe.watch(deleting_key, routes_key)
                        blocked = _marked(await pipe.hgetall(deleting_key), adapters, time.time())
                        if blocked is None:
                            await check(sorted(name.decode() for name in await pipe.hkeys(routes_key)))
                            pipe.multi()
                            pipe.hset(routes_key, check_route_name(route.name), msgspec.json.encode(route))
                            pipe.publish(self.channel, msgspec.json.encode(event))
                            await pipe.execute()
                            return
                except WatchError:
                    pass  # a mark or a route changed since the WATCH: check again
                except (RedisError, OSError) as exc:
                    raise ConfigStoreUnavailable(self._describe(exc)) from exc
                if time.monotonic() > deadline:
                    raise AdapterBeingDeleted(blocked or next(iter(adapters)))
                if blocked is not None:
                    await asyncio.sleep(0.05)

    @contextlib.asynccontextmanager
    async def adapter_deletion(
        self, tenant: str, name: str
    ) -> AsyncIterator[Callable[[], Awaitable[list[Route]]]]:
        key, field = self._deleting_key(tenant), f"{name} {uuid.uuid4().hex}"
        async with self._tenant_lock(tenant):
            now = time.time()
            marks = await self._call(self._client.hgetall(key))
            expired = [f for f, until in marks.items() if _expiry(until) <= now]
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(key, field, str(now + DELETION_MARK_TTL_S))
            if expired:
                pipe.hdel(key, *expired)
            await self._call(pipe.execute())
            try:
                yield lambda: self.list_routes(tenant)  # straight from Redis, after the mark
            finally:
                try:
                    await self._call(self._client.hdel(key, field))
                except ConfigStoreUnavailable as exc:  # it expires on its own
                    log.warning("could not clear the deletion mark of %s/%s: %s", tenant, name, exc)

    async def delete_route(self, tenant: str, name: str) -> bool:
        if not (is_valid_name(tenant) and is_valid_name(name)):
            return False
        event = ConfigEvent(kind="route", op="delete", tenant=tenant, name=name)
        pipe = self._client.pipeline(transaction=True)
        pipe.hdel(self._routes_key(tenant), name)
        pipe.publish(self.channel, msgspec.json.encode(event))
        deleted, _ = await self._call(pipe.execute())
        return bool(deleted)

    async def list_routes(self, tenant: str) -> list[Route]:
        if not is_valid_name(tenant):
            return []
        raw = await self._call(self._client.hgetall(self._routes_key(tenant)))
        routes = _decode_all(raw, Route, f"routes of {tenant}")
        return sorted(routes, key=lambda route: route.name)

    # keys

    async def get_key(self, key_hash: str) -> ApiKey | None:
        raw = await self._call(self._client.hget(self._keys_key(), _check_hash(key_hash)))
        return _decode(raw, ApiKey, f"key {key_hash[:12]}")

    async def put_key(self, key: ApiKey) -> None:
        check_tenant(key.tenant)
        event = ConfigEvent(kind="key", op="put", name=key.key_hash)
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self._keys_key(), _check_hash(key.key_hash), msgspec.json.encode(key))
        pipe.publish(self.channel, msgspec.json.encode(event))
        await self._call(pipe.execute())

    async def delete_key(self, key_hash: str) -> bool:
        event = ConfigEvent(kind="key", op="delete", name=key_hash)
        pipe = self._client.pipeline(transaction=True)
        pipe.hdel(self._keys_key(), _check_hash(key_hash))
        pipe.publish(self.channel, msgspec.json.encode(event))
        deleted, _ = await self._call(pipe.execute())
        return bool(deleted)

    async def list_keys(self) -> list[ApiKey]:
        keys = _decode_all(await self._call(self._client.hgetall(self._keys_key())), ApiKey, "keys")
        return sorted(keys, key=lambda key: (key.tenant, key.key_hash))

    # events and lifecycle

    async def announce_adapter_change(self, tenant: str, name: str, op: Literal["put", "delete"]) -> None:
        event = ConfigEvent(kind="adapter", op=op, tenant=check_tenant(tenant), name=name)
        await self._call(self._client.publish(self.channel, msgspec.json.encode(event)))

    async def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        unsubscribe = self._subscribers.add(callback)
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name=f"config-listener {self.channel}")
        await self._first_attempt.wait()
        return unsubscribe

    async def ping(self) -> None:
        await self._call(self._client.ping())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        await self._client.aclose()

    async def _listen(self) -> None:
        delay = self._retry_initial_s
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # First subscription or redis-py's own reconnect: anything may have been missed.
                        self.listening = True
                        delay = self._retry_initial_s
                        self._subscribers.emit(ConfigEvent(kind="resync"))
                        self._first_attempt.set()
                    elif message["type"] == "message":
                        self._dispatch(message["data"])
            except Exception as exc:  # the listener must outlive any failure, or caches go stale
                self.listening = False
                reason = self._describe(exc)
                if isinstance(exc, (RedisError, OSError)):
                    log.warning("config change channel lost (%s); retrying in %.1f s", reason, delay)
                else:
                    log.exception("config change listener failed; retrying in %.1f s", delay)
                self._subscribers.emit(ConfigEvent(kind="disconnected", error=reason))
                self._first_attempt.set()
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._retry_max_s)

    def _dispatch(self, data: bytes) -> None:
        try:
            event = msgspec.json.decode(data, type=ConfigEvent)
        except msgspec.DecodeError:
            log.warning("ignoring a malformed message on %s", self.channel)
            return
        self._subscribers.emit(event)

    # helpers

    def _routes_key(self, tenant: str) -> str:
        return f"{self.prefix}:routes:{check_tenant(tenant)}"

    def _keys_key(self) -> str:
        return f"{self.prefix}:keys"

    def _deleting_key(self, tenant: str) -> str:
        return f"{self.prefix}:deleting:{check_tenant(tenant)}"

    async def _call(self, awaitable):
        try:
            return await awaitable
        except (RedisError, OSError) as exc:
            raise ConfigStoreUnavailable(self._describe(exc)) from exc

    def _describe(self, exc: BaseException) -> str:
        return f"redis config store at {self._where} unreachable: {type(exc).__name__}: {exc}"


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _marked(marks: dict[bytes, bytes], adapters: set[str], now: float) -> str | None:
    """The first of `adapters` a live deletion mark names, or None."""
    for field, until in marks.items():
        name = field.decode(errors="replace").partition(" ")[0]
        if name in adapters and _expiry(until) > now:
            return name
    return None


def _expiry(raw: bytes) -> float:
    try:
        return float(raw)
    except ValueError:
        return 0.0  # unreadable: treated as expired


def _check_hash(key_hash: str) -> str:
    if not is_key_hash(key_hash):
        raise ValueError("key_hash must be 64 lowercase hex digits (sha256 of the key, see tenancy.hash_key)")
    return key_hash


def _decode(raw: bytes | None, type_: type[T], what: str) -> T | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.DecodeError as exc:
        raise ConfigStoreError(f"{what} in Redis is corrupt ({exc}); rewrite or delete it") from exc


def _decode_all(raw: dict[bytes, bytes], type_: type[T], what: str) -> list[T]:
    records = []
    for field, value in raw.items():
        try:
            records.append(msgspec.json.decode(value, type=type_))
        except msgspec.DecodeError as exc:
            log.warning("skipping corrupt entry %r of %s: %s", field, what, exc)
    return records
