"""Config change events between the front-end processes of one server (embedded config store only).

The embedded config store tells only its own process about a change (config_store/embedded.py). With
several front-end processes on one store folder, a route set through one process must also drop the
others' cached copy, or they would serve the old one forever. So each front end publishes its store's
events to a hub in the supervisor (a ZeroMQ XSUB/XPUB proxy) and receives every other front end's:

    front end 0 --PUB--> events-in [XSUB  hub  XPUB] events-out --SUB--> front ends 0..N-1
                                                                          (each skips its own)

The same wrapper makes the store's per-tenant write lock (route writes against adapter deletions, the
route quota) hold across the front ends: frontends.tenant_locks.

A Redis config store needs none of this: every process subscribes to Redis itself, and its route writes
are transactions in Redis. An event that
arrives while a front end is (re)starting is lost to it, which is harmless: a starting process has
nothing cached yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from loraserve.config_store.base import ConfigStore
from loraserve.config_store.events import ConfigEvent, EventCallback, Subscribers
from loraserve.frontends.tenant_locks import SharedTenantLock, SharedTenantLocks
from loraserve.routing.route import Route
from loraserve.tenancy.keys import ApiKey

log = logging.getLogger(__name__)


class _Envelope(msgspec.Struct, frozen=True, array_like=True):
    origin: str  # the publishing front end's client id
    event: ConfigEvent


_decode = msgspec.msgpack.Decoder(_Envelope).decode
_encode = msgspec.msgpack.Encoder().encode


def start_hub(events_in: str, events_out: str) -> threading.Thread:
    """The supervisor's forwarder, on a daemon thread that lives as long as the process."""
    context = zmq.Context.instance()
    frontend = context.socket(zmq.XSUB)
    backend = context.socket(zmq.XPUB)
    frontend.bind(events_in)
    backend.bind(events_out)

    def forward() -> None:
        with contextlib.suppress(zmq.ContextTerminated, zmq.ZMQError):
            zmq.proxy(frontend, backend)

    thread = threading.Thread(target=forward, name="config-event-hub", daemon=True)
    thread.start()
    return thread


class PeerEventsConfigStore(ConfigStore):
    """A config store whose change events also reach, and come from, the other front-end processes."""

    def __init__(
        self, backend: ConfigStore, events_in: str, events_out: str, origin: str, locks: SharedTenantLocks
    ) -> None:
        self.backend = backend
        self._locks = locks
        self._origin = origin
        self._subscribers = Subscribers()
        self._context = zmq.asyncio.Context()
        self._publisher = self._context.socket(zmq.PUB)
        self._publisher.setsockopt(zmq.LINGER, 0)
        self._publisher.connect(events_in)
        self._subscriber = self._context.socket(zmq.SUB)
        self._subscriber.setsockopt(zmq.LINGER, 0)
        self._subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        self._subscriber.connect(events_out)
        self._reader: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"PeerEventsConfigStore({self.backend!r})"

    async def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        if self._unsubscribe is None:  # the first subscriber starts the relay both ways
            self._unsubscribe = await self.backend.subscribe(self._local)
            self._reader = asyncio.create_task(self._read(), name="config-events-from-peers")
        return self._subscribers.add(callback)

    def _local(self, event: ConfigEvent) -> None:
        if event.kind in ("route", "key", "adapter"):
            try:
                self._publisher.send(_encode(_Envelope(self._origin, event)), zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the hub is gone (the server is stopping): local only
                log.warning("could not tell the other front ends about %s: %s", event, exc)
        self._subscribers.emit(event)

    async def _read(self) -> None:
        while True:
            data = await self._subscriber.recv()
            try:
                envelope = _decode(data)
            except msgspec.DecodeError:
                log.error("dropped a config event from a peer that does not decode")
                continue
            if envelope.origin != self._origin:
                self._subscribers.emit(envelope.event)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._publisher.close(linger=0)
        self._subscriber.close(linger=0)
        self._context.term()
        await self.backend.close()

    def _tenant_lock(self, tenant: str) -> SharedTenantLock:
        """put_route_checked and adapter_deletion (ConfigStore's) take this: one writer per tenant across
        every front-end process, not only within this one."""
        return self._locks(tenant)

    # Everything else is the backend's.

    async def get_route(self, tenant: str, name: str) -> Route | None:
        return await self.backend.get_route(tenant, name)

    async def put_route(self, tenant: str, route: Route) -> None:
        await self.backend.put_route(tenant, route)

    async def delete_route(self, tenant: str, name: str) -> bool:
        return await self.backend.delete_route(tenant, name)

    async def list_routes(self, tenant: str) -> list[Route]:
        return await self.backend.list_routes(tenant)

    async def get_key(self, key_hash: str) -> ApiKey | None:
        return await self.backend.get_key(key_hash)

    async def put_key(self, key: ApiKey) -> None:
        await self.backend.put_key(key)

    async def delete_key(self, key_hash: str) -> bool:
        return await self.backend.delete_key(key_hash)

    async def list_keys(self) -> list[ApiKey]:
        return await self.backend.list_keys()

    async def announce_adapter_change(self, tenant: str, name: str, op: Literal["put", "delete"]) -> None:
        await self.backend.announce_adapter_change(tenant, name, op)

    async def ping(self) -> None:
        await self.backend.ping()
