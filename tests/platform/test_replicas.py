"""Two replicas sharing one Redis config store and one S3 adapter store see each other's changes within 1 s.

Each replica is a full app (create_app) with its own S3 client, its own cached view of Redis and its
own adapter-lookup cache, as two `loraserve serve` processes would have. Litestar's TestClient runs
each app on its own event loop in a thread; async calls into a replica go through its portal.
"""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack

from api_env import ADMIN_A, USER_A, bearer, build_app, build_services, tiny_shape, upload_files
from litestar.testing import TestClient
from loraserve.config_store import CachedConfigStore, RedisConfigStore
from loraserve.resolution import ModelNotFound, resolve_model

from adapters_store import StoreConfig
from adapters_store.s3 import S3Store

WITHIN_S = 1.0


class Replica:
    def __init__(self, services, client: TestClient) -> None:
        self.services = services
        self.client = client

    def served(self, model: str) -> str | None:
        """The adapter this replica serves for `model` (as USER_A, sticky user `user-1`); None if not found."""

        async def resolve():
            principal = await self.services.authenticator.authenticate(f"Bearer {USER_A}")
            try:
                return (await resolve_model(self.services, principal, model, "user-1")).served_model
            except ModelNotFound:
                return None

        return self.client.blocking_portal.call(resolve)


def eventually(check, expected, within_s: float = WITHIN_S) -> float:
    """Poll `check()` until it returns `expected`; the seconds it took, failing past `within_s`."""
    start = time.monotonic()
    while (got := check()) != expected:
        assert time.monotonic() - start < within_s, f"still {got!r}, not {expected!r}, after {within_s} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_uploads_and_route_changes_reach_the_other_replica_within_a_second(
    tmp_path, redis_server, s3_endpoint, s3_bucket, peft_adapters
):
    prefix = f"replicas-{uuid.uuid4().hex[:8]}"
    store_config = StoreConfig(url=f"s3://{s3_bucket}/tenants", endpoint_url=s3_endpoint, retries=1)

    def start(stack: ExitStack, name: str) -> Replica:
        services = build_services(
            tmp_path / name,
            store=S3Store(s3_bucket, "tenants", store_config, tiny_shape()),
            config_store=CachedConfigStore(RedisConfigStore(redis_server.url, prefix=prefix)),
        )
        client = stack.enter_context(TestClient(build_app(services)))
        client.blocking_portal.call(services.config_store.start)  # on the replica's own loop
        stack.callback(client.blocking_portal.call, services.config_store.close)
        return Replica(services, client)

    def upload(replica: Replica, name: str, folder) -> None:
        response = replica.client.post(
            "/v1/adapters", data={"name": name}, files=upload_files(folder), headers=bearer(ADMIN_A)
        )
        assert response.status_code == 201, response.text

    def put_route(replica: Replica, adapter: str) -> None:
        route = {"variants": [{"adapter": adapter, "weight": 1}], "sticky": "user"}
        response = replica.client.put("/v1/routes/exp", json=route, headers=bearer(ADMIN_A))
        assert response.status_code == 200, response.text

    with ExitStack() as stack:
        a, b = start(stack, "a"), start(stack, "b")
        assert b.served("bot") is None  # B now caches "no such adapter" for a moment

        upload(a, "bot", peft_adapters["qv"])
        eventually(lambda: b.served("bot"), "bot@1")
        assert [x["name"] for x in b.client.get("/v1/adapters", headers=bearer(USER_A)).json()["data"]] == [
            "bot"
        ]

        assert a.served("bot") == "bot@1"  # A caches bot -> bot@1 for a moment
        upload(b, "bot", peft_adapters["all"])
        eventually(lambda: a.served("bot"), "bot@2")

        put_route(a, "bot@1")
        eventually(lambda: b.served("exp"), "bot@1")
        put_route(a, "bot@2")
        eventually(lambda: b.served("exp"), "bot@2")
        assert (
            b.client.get("/v1/routes/exp", headers=bearer(USER_A)).json()["variants"][0]["adapter"] == "bot@2"
        )

        assert b.client.delete("/v1/routes/exp", headers=bearer(ADMIN_A)).status_code == 200
        eventually(lambda: a.served("exp"), None)
        assert b.served("bot") == "bot@2"
        assert a.client.delete("/v1/adapters/bot", headers=bearer(ADMIN_A)).status_code == 200
        eventually(lambda: b.served("bot"), None)
