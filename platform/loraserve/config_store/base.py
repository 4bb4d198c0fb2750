"""The config store interface: per-tenant routes and API keys (by hash), with change events.

Backends (embedded files, Redis) implement it; CachedConfigStore wraps one of them for the server.
Routes are namespaced by tenant: no method reads across tenants, so tenant A cannot see B's routes
through the store. Keys are global (a key's record says which tenant it belongs to).

Route writes and adapter deletions are atomic with respect to each other (`put_route_checked`,
`adapter_deletion`): a route is written only after its check ran with no deletion of an adapter it names
in progress, and a deletion sees every route written before it could be refused, so no route ever points
at a version deleted under it. Here with one lock per tenant, enough for a store that one process uses
(embedded); the Redis store adds a mark in Redis and a transaction, for replicas.

Names: writes raise InvalidName for a tenant or route name outside adapter_format/names.py's syntax; reads
answer None / False / [] instead, since nothing can be stored under such a name, so a request's
`model` can be looked up as a route whatever it is. Key hashes must be 64 hex digits (ValueError).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal

from loraserve.config_store.events import EventCallback
from loraserve.routing.route import Route
from loraserve.tenancy.keys import ApiKey


class ConfigStore(abc.ABC):
    @abc.abstractmethod
    async def get_route(self, tenant: str, name: str) -> Route | None: ...

    @abc.abstractmethod
    async def put_route(self, tenant: str, route: Route) -> None:
        """Create or replace; the caller has validated the route (routing.parse_route)."""

    async def put_route_checked(
        self, tenant: str, route: Route, check: Callable[[list[str]], Awaitable[None]]
    ) -> None:
        """Create or replace `route` if `check(names)` passes, `names` being the tenant's route names as
        stored when it runs; atomic with respect to the tenant's other checked route writes and to
        `adapter_deletion` of any adapter it names. `check` raises to refuse (a quota, a missing adapter)."""
        async with self._tenant_lock(tenant):
            await check([existing.name for existing in await self.list_routes(tenant)])
            await self.put_route(tenant, route)

    @asynccontextmanager
    async def adapter_deletion(
        self, tenant: str, name: str
    ) -> AsyncIterator[Callable[[], Awaitable[list[Route]]]]:
        """While the block deletes versions of adapter `name`, no checked route write naming it lands;
        yields a function that reads the tenant's routes as stored now (never from a cache), to refuse the
        deletion if one needs what it deletes."""
        async with self._tenant_lock(tenant):
            yield lambda: self.list_routes(tenant)

    def _tenant_lock(self, tenant: str) -> asyncio.Lock:
        locks: dict[str, asyncio.Lock] = self.__dict__.setdefault("_route_write_locks", {})
        return locks.setdefault(tenant, asyncio.Lock())

    @abc.abstractmethod
    async def delete_route(self, tenant: str, name: str) -> bool:
        """True when a route was deleted, False when there was none."""

    @abc.abstractmethod
    async def list_routes(self, tenant: str) -> list[Route]:
        """The tenant's routes, sorted by name."""

    @abc.abstractmethod
    async def get_key(self, key_hash: str) -> ApiKey | None: ...

    @abc.abstractmethod
    async def put_key(self, key: ApiKey) -> None: ...

    @abc.abstractmethod
    async def delete_key(self, key_hash: str) -> bool: ...

    @abc.abstractmethod
    async def list_keys(self) -> list[ApiKey]:
        """Every key record, sorted by tenant then hash."""

    @abc.abstractmethod
    async def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Call `callback(ConfigEvent)` on every change; returns the function that unsubscribes.

        Returns once the subscription is live (or its first attempt failed, which it reports as a
        `disconnected` event and keeps retrying), so changes made after it returns are not missed.
        """

    async def announce_adapter_change(self, tenant: str, name: str, op: Literal["put", "delete"]) -> None:
        """Tell every subscriber (every replica, through Redis) that one adapter's versions changed.

        The adapter store has no change feed of its own, so the replica that uploads or deletes announces
        it here and the others drop their cached lookups. A store without events has nothing to tell.
        """
        return None

    @abc.abstractmethod
    async def ping(self) -> None:
        """Return when the backend answers; raise ConfigStoreUnavailable with the reason otherwise."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> ConfigStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
