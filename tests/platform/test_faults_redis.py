"""Fault injection: the Redis config store killed (SIGKILL) under a serving replica, then restarted.

While Redis is down the replica keeps serving with the last known keys, routes and adapter lookups,
/health and /ready answer at once, and a caller whose key cannot be checked gets a 503 that names no
Redis address. After the restart, changes flow again: a route change and an adapter upload made
through this replica reach a second replica's caches through the event channel within seconds.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from app_fixtures import keys_for, make_text_model, open_test_services
from factories import make_adapter
from loraserve.adapter_lookup import AdapterLookup
from loraserve.app import create_app
from loraserve.config_store import CachedConfigStore, RedisConfigStore
from loraserve.settings import ServerSettings
from loraserve.tenancy import ApiKey, hash_key

REQUESTS = 30
REQUEST_TIMEOUT_S = 8.0
PROBE_LIMIT_S = 1.0
ADMIN, USER = "sk-admin-file", "sk-user-in-redis"  # the user key exists only in Redis


@pytest.mark.slow
def test_redis_killed_and_restarted(tmp_path, redis_server_factory):
    redis = redis_server_factory()
    prefix = f"faults-{uuid.uuid4().hex[:8]}"
    model_dir = make_text_model(tmp_path / "model")
    adapter = make_adapter(model_dir, tmp_path / "a", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"])
    report = {}

    def cached_store() -> CachedConfigStore:
        return CachedConfigStore(RedisConfigStore(redis.url, prefix=prefix, retry_max_s=0.5), retry_max_s=0.5)

    async def main():
        other = await cached_store().start()  # a second replica's view, with its own adapter lookups
        other_lookup = AdapterLookup()
        await other.subscribe(other_lookup.on_config_event)
        async with open_test_services(
            tmp_path,
            model_dir,
            api_keys=keys_for(default=(ADMIN, "admin", None)),
            config_store=cached_store(),
        ) as services:
            await services.config_store.start()
            await services.config_store.put_key(ApiKey(key_hash=hash_key(USER), tenant="default"))
            app = create_app(ServerSettings(), services=services)
            transport = httpx.ASGITransport(app=app)
            async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                await scenario(client, services, other, other_lookup)
        other_lookup.close()
        await other.close()

    async def scenario(client, services, other, other_lookup):
        admin, user = {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": f"Bearer {USER}"}
        files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir())]
        upload = await client.post("/v1/adapters", data={"name": "a"}, files=files, headers=admin)
        assert upload.status_code == 201, upload.text
        route = {"variants": [{"adapter": "a@1", "weight": 1}], "sticky": "none"}
        assert (await client.put("/v1/routes/r", json=route, headers=admin)).status_code == 200
        models = ["r", "a", "tiny"]
        for model in models:  # warm the caches: key, route, adapter lookup
            response = await client.post("/v1/completions", json=completion(model), headers=user)
            assert response.status_code == 200, response.text

        redis.stop()  # SIGKILL
        outage = await asyncio.gather(
            *(
                timed(client.post("/v1/completions", json=completion(models[i % 3]), headers=user))
                for i in range(REQUESTS)
            )
        )
        probes = [await timed(client.get(path)) for path in ("/health", "/ready")]
        wrong_key, _ = await timed(client.get("/v1/models", headers={"Authorization": "Bearer sk-nobody"}))
        lost = sum(1 for r, _ in outage if r is not None and r.status_code != 200)
        hung = sum(1 for r, _ in outage if r is None)
        report.update(faults=1, requests=REQUESTS, lost=lost, hung=hung)
        assert (lost, hung) == (0, 0), [r.text for r, _ in outage if r is not None and r.status_code != 200]
        for response, seconds in probes:
            assert response is not None and response.status_code == 200 and seconds < PROBE_LIMIT_S
        assert "config store unreachable" in probes[1][0].json()["degraded"][0]
        assert wrong_key is not None and wrong_key.status_code == 503
        assert wrong_key.json()["error"]["code"] == "config_store_unavailable"
        assert str(redis.port) not in wrong_key.text and "redis" not in wrong_key.text.lower()
        assert str(redis.port) not in probes[1][0].text

        redis.start()  # same port, same data (append-only file)
        await eventually(lambda: services.config_store.healthy and other.healthy, within_s=10)
        assert (await other.get_route("default", "r")).variants[0].weight == 1  # now cached there
        route = {"variants": [{"adapter": "a", "weight": 3}], "sticky": "none"}
        assert (await client.put("/v1/routes/r", json=route, headers=admin)).status_code == 200

        async def other_sees_route() -> bool:
            seen = await other.get_route("default", "r")
            return seen is not None and seen.variants[0].weight == 3

        report["route_change_s"] = await eventually(other_sees_route, within_s=3)
        store = services.adapter_store
        assert (await other_lookup.resolve(store, "default", "a")).version == 1  # cached for 30 s
        upload = await client.post("/v1/adapters", data={"name": "a"}, files=files, headers=admin)
        assert upload.status_code == 201, upload.text

        async def other_sees_upload() -> bool:
            return (await other_lookup.resolve(store, "default", "a")).version == 2

        report["adapter_event_s"] = await eventually(other_sees_upload, within_s=3)
        after = await client.post("/v1/completions", json=completion("a"), headers=user)
        assert after.status_code == 200 and after.json()["model"] == "a@2"

    asyncio.run(main())
    print(f"\nRedis fault injection: {report}")


def completion(model: str) -> dict:
    return {"model": model, "prompt": [4, 5, 6], "max_tokens": 3, "temperature": 0}


async def timed(call) -> tuple[httpx.Response | None, float]:
    started = time.monotonic()
    try:
        return await asyncio.wait_for(call, REQUEST_TIMEOUT_S), time.monotonic() - started
    except TimeoutError:
        return None, time.monotonic() - started


async def eventually(check, within_s: float) -> float:
    """Poll `check` (sync or async) until it is true; the seconds it took."""
    started = time.monotonic()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - started
        assert time.monotonic() - started < within_s, f"not within {within_s} s"
        await asyncio.sleep(0.05)
