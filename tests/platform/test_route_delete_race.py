"""A route PUT racing the deletion of the version it names never leaves the route pointing at a deleted
version: on one replica (embedded config store, and Redis) and across two replicas sharing Redis. Each round
uploads a version, then runs the PUT and the DELETE at once, with random waits inside their store calls so
the steps interleave differently; exactly one of the two may win, and the stored route must resolve.

Also: the per-tenant route quota (`--max-routes-per-tenant`), counted atomically under the same guard."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import pytest
from api_env import KEYS, FakeEngine, build_services
from loraserve.adapters.service import delete_adapter
from loraserve.config_store import CachedConfigStore, EmbeddedConfigStore, RedisConfigStore
from loraserve.errors import APIError
from loraserve.routes.service import RouteQuotaExceeded, put_route
from loraserve.routing import InvalidRoute
from loraserve.tenancy import Principal

from adapters_store import AdapterNotFound, LocalStore

ROUNDS = 30
ADMIN = Principal(tenant="alpha", role="admin")
assert KEYS  # the tenants api_env's services know


def jittered(store: LocalStore, rng: random.Random) -> None:
    """Random waits (0-4 ms) inside the store calls both sides make, so their steps interleave."""
    for method in ("get", "versions", "delete"):
        real = getattr(store, method)

        def slow(*args, _real=real, **kwargs):
            time.sleep(rng.random() * 0.004)
            return _real(*args, **kwargs)

        setattr(store, method, slow)


async def after(seconds: float, call):
    await asyncio.sleep(seconds)
    return await call


async def race(put_side, delete_side, peft_adapter, rounds: int, seed: int) -> dict[str, int]:
    """`put_side`/`delete_side`: Services of the replica that PUTs / DELETEs (may be the same). Either side
    starts first, after a random head start of up to 10 ms."""
    rng = random.Random(seed)
    store = delete_side.adapter_store
    outcomes = {"route_won": 0, "delete_won": 0}
    for _ in range(rounds):
        version = store.put("alpha", "a", peft_adapter).version
        body = json.dumps({"variants": [{"adapter": f"a@{version}", "weight": 1}]}).encode()
        put, deleted = await asyncio.gather(
            after(rng.random() * 0.01, put_route(put_side, ADMIN, "r", body)),
            after(rng.random() * 0.01, delete_adapter(delete_side, ADMIN, f"a@{version}")),
            return_exceptions=True,
        )
        route = await put_side.config_store.backend.get_route("alpha", "r")
        target = route.variants[0].adapter if route is not None else None
        if target is not None:
            try:
                store.resolve("alpha", target)
            except AdapterNotFound:
                pytest.fail(f"route r points at deleted {target} (put: {put!r}, delete: {deleted!r})")
        put_ok, delete_ok = not isinstance(put, BaseException), not isinstance(deleted, BaseException)
        assert put_ok != delete_ok, (put, deleted)  # exactly one wins
        if put_ok:
            assert isinstance(deleted, APIError) and deleted.code == "adapter_in_use", deleted
            outcomes["route_won"] += 1
        else:
            assert isinstance(put, InvalidRoute), put
            outcomes["delete_won"] += 1
    return outcomes


def services_with(tmp_path, config_store, seed: int):
    services = build_services(tmp_path, config_store=CachedConfigStore(config_store), engine=FakeEngine())
    jittered(services.adapter_store, random.Random(seed))
    return services


def test_one_replica_embedded(tmp_path, peft_adapters):
    services = services_with(tmp_path, EmbeddedConfigStore(tmp_path / "config"), seed=1)
    outcomes = asyncio.run(race(services, services, peft_adapters["qv"], ROUNDS, seed=5))
    print(f"\nembedded, one replica: {outcomes}")


def test_one_replica_redis(tmp_path, redis_server, peft_adapters):
    async def main():
        backend = RedisConfigStore(redis_server.url, prefix=f"race-{uuid.uuid4().hex[:8]}")
        services = services_with(tmp_path, backend, seed=2)
        try:
            return await race(services, services, peft_adapters["qv"], ROUNDS, seed=5)
        finally:
            await services.config_store.close()

    print(f"\nredis, one replica: {asyncio.run(main())}")


def test_two_replicas_redis(tmp_path, redis_server, peft_adapters):
    """Replica 1 PUTs, replica 2 DELETEs: two config store clients, one Redis, one adapter store."""
    prefix = f"race-{uuid.uuid4().hex[:8]}"

    async def main():
        first = services_with(tmp_path / "one", RedisConfigStore(redis_server.url, prefix=prefix), seed=3)
        second = build_services(
            tmp_path / "two",
            store=first.adapter_store,
            config_store=CachedConfigStore(RedisConfigStore(redis_server.url, prefix=prefix)),
            engine=FakeEngine(),
        )
        try:
            return await race(first, second, peft_adapters["qv"], ROUNDS, seed=6)
        finally:
            await first.config_store.close()
            await second.config_store.close()

    print(f"\nredis, two replicas: {asyncio.run(main())}")


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_the_route_quota_is_exact_under_concurrent_puts(tmp_path, redis_server, peft_adapters, backend):
    async def main():
        if backend == "redis":
            store = RedisConfigStore(redis_server.url, prefix=f"quota-{uuid.uuid4().hex[:8]}")
        else:
            store = EmbeddedConfigStore(tmp_path / "config")
        services = services_with(tmp_path, store, seed=4)
        services.max_routes_per_tenant = 3
        services.adapter_store.put("alpha", "a", peft_adapters["qv"])
        body = json.dumps({"variants": [{"adapter": "a", "weight": 1}]}).encode()
        results = await asyncio.gather(
            *(put_route(services, ADMIN, f"r{i}", body) for i in range(8)), return_exceptions=True
        )
        replaced = await put_route(
            services, ADMIN, next(r.name for r in results if not isinstance(r, Exception)), body
        )
        stored = await services.config_store.backend.list_routes("alpha")
        await services.config_store.close()
        return results, replaced, stored

    results, replaced, stored = asyncio.run(main())
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(stored) == 3 and len(refused) == 5, results
    assert all(isinstance(r, RouteQuotaExceeded) for r in refused), refused
    assert refused[0].status_code == 403 and "--max-routes-per-tenant is 3" in str(refused[0])
    assert replaced is not None  # replacing an existing route is not a new one
