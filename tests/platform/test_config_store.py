"""Config store: both backends through one interface, the cache in front, Redis outages and crashes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as redis
from loraserve.config_store import (
    CachedConfigStore,
    ConfigEvent,
    ConfigStore,
    ConfigStoreUnavailable,
    EmbeddedConfigStore,
    RedisConfigStore,
    open_config_store,
    redact_url,
)
from loraserve.config_store import atomic as atomic_module
from loraserve.routing import Route, Variant
from loraserve.tenancy import ApiKey, InvalidName, hash_key


def route(name: str, *weights: int, sticky: str = "user") -> Route:
    variants = tuple(Variant(adapter=f"adapter-{i}", weight=w) for i, w in enumerate(weights))
    return Route(name=name, variants=variants, sticky=sticky)


def api_key(key: str, tenant: str, role: str = "user", limit: int | None = None) -> ApiKey:
    return ApiKey(key_hash=hash_key(key), tenant=tenant, role=role, max_concurrent_requests=limit)


async def eventually(check, timeout_s: float = 1.0, interval_s: float = 0.01) -> float:
    """Await `check()` until truthy; the seconds it took. Fails after timeout_s."""
    start = time.monotonic()
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


@pytest.fixture(params=["embedded", "redis"])
def make_store(request, tmp_path):
    """make_store() -> a new backend instance over the same data (same folder, or same Redis prefix)."""
    if request.param == "embedded":
        return lambda: EmbeddedConfigStore(tmp_path / "config")
    server = request.getfixturevalue("redis_server")
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    return lambda: RedisConfigStore(server.url, prefix=prefix, retry_initial_s=0.05, retry_max_s=0.2)


# both backends


def test_route_crud(make_store):
    async def scenario():
        async with make_store() as store:
            assert await store.get_route("acme", "chat") is None
            assert await store.list_routes("acme") == []
            await store.put_route("acme", route("chat", 90, 10))
            await store.put_route("acme", route("beta", 1, sticky="none"))
            assert await store.get_route("acme", "chat") == route("chat", 90, 10)
            assert [r.name for r in await store.list_routes("acme")] == ["beta", "chat"]
            await store.put_route("acme", route("chat", 80, 20))  # replace
            assert await store.get_route("acme", "chat") == route("chat", 80, 20)
            assert await store.delete_route("acme", "chat") is True
            assert await store.delete_route("acme", "chat") is False
            assert await store.get_route("acme", "chat") is None
            assert await store.list_routes("acme") == [route("beta", 1, sticky="none")]
        async with make_store() as reopened:  # persisted, not held by the instance
            assert await reopened.get_route("acme", "beta") == route("beta", 1, sticky="none")

    asyncio.run(scenario())


def test_key_crud(make_store):
    async def scenario():
        async with make_store() as store:
            alice, bob = api_key("sk-alice", "alice", "admin", 4), api_key("sk-bob", "bob")
            assert await store.get_key(alice.key_hash) is None
            await store.put_key(alice)
            await store.put_key(bob)
            assert await store.get_key(alice.key_hash) == alice
            assert await store.list_keys() == [alice, bob]
            await store.put_key(api_key("sk-bob", "bob", "admin"))
            assert (await store.get_key(bob.key_hash)).role == "admin"
            assert await store.delete_key(bob.key_hash) is True
            assert await store.delete_key(bob.key_hash) is False
            assert await store.list_keys() == [alice]

    asyncio.run(scenario())


def test_keys_are_stored_as_hashes_only(make_store):
    async def scenario():
        async with make_store() as store:
            await store.put_key(api_key("sk-very-secret-key", "alice"))
            if isinstance(store, EmbeddedConfigStore):
                blobs = [p.read_bytes() for p in store.root.rglob("*") if p.is_file()]
            else:
                raw = redis.Redis.from_url(store.url)
                blobs = [v for v in (await raw.hgetall(f"{store.prefix}:keys")).values()]
                blobs += [k for k in (await raw.hgetall(f"{store.prefix}:keys"))]
                await raw.aclose()
            assert blobs and not any(b"sk-very-secret-key" in blob for blob in blobs)
            assert any(hash_key("sk-very-secret-key").encode() in blob for blob in blobs)

    asyncio.run(scenario())


def test_routes_are_namespaced_by_tenant(make_store):
    async def scenario():
        async with make_store() as store:
            await store.put_route("tenant-a", route("shared-name", 1))
            assert await store.get_route("tenant-b", "shared-name") is None
            assert await store.list_routes("tenant-b") == []
            assert await store.delete_route("tenant-b", "shared-name") is False
            await store.put_route("tenant-b", route("shared-name", 2, 3))
            assert await store.get_route("tenant-a", "shared-name") == route("shared-name", 1)
            assert await store.get_route("tenant-b", "shared-name") == route("shared-name", 2, 3)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "tenant, name",
    [("acme", "org/model"), ("../etc", "x"), ("a", "../../x"), ("a/b", "x"), ("a", ".hidden"), ("", "x")],
)
def test_names_that_could_escape_are_refused_on_write_and_absent_on_read(make_store, tenant, name):
    async def scenario():
        async with make_store() as store:
            with pytest.raises(InvalidName):
                await store.put_route(tenant, route(name, 1))
            assert await store.get_route(tenant, name) is None  # cannot exist: a lookup, not an error
            assert await store.delete_route(tenant, name) is False
            with pytest.raises(ValueError, match="64 lowercase hex"):
                await store.get_key("../../not-a-hash")

    asyncio.run(scenario())


def test_subscribers_see_every_change(make_store):
    async def scenario():
        async with make_store() as store:
            events: list[ConfigEvent] = []
            unsubscribe = await store.subscribe(events.append)
            await store.put_route("acme", route("chat", 1))
            await store.delete_route("acme", "chat")
            key = api_key("k", "acme")
            await store.put_key(key)
            changes = [
                ("route", "put", "acme", "chat"),
                ("route", "delete", "acme", "chat"),
                ("key", "put", None, key.key_hash),
            ]

            async def all_seen():
                return [
                    (e.kind, e.op, e.tenant, e.name) for e in events if e.kind in ("route", "key")
                ] == changes

            await eventually(all_seen)
            unsubscribe()
            await store.delete_key(key.key_hash)
            await asyncio.sleep(0.05)
            assert len([e for e in events if e.kind == "key"]) == 1

    asyncio.run(scenario())


# embedded: atomic writes


def test_failed_write_keeps_old_value_and_leaves_no_temp_file(tmp_path, monkeypatch):
    async def scenario():
        store = EmbeddedConfigStore(tmp_path)
        await store.put_route("acme", route("chat", 90, 10))

        def crash(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(atomic_module.os, "replace", crash)
        with pytest.raises(ConfigStoreUnavailable, match="No space left"):
            await store.put_route("acme", route("chat", 50, 50))
        monkeypatch.undo()
        assert await store.get_route("acme", "chat") == route("chat", 90, 10)
        assert sorted(p.name for p in (tmp_path / "routes" / "acme").iterdir()) == ["chat.json"]

    asyncio.run(scenario())


def test_temp_files_left_by_a_crash_are_ignored(tmp_path):
    async def scenario():
        store = EmbeddedConfigStore(tmp_path)
        await store.put_route("acme", route("chat", 90, 10))
        folder = tmp_path / "routes" / "acme"
        (folder / ".chat.json.abc123.tmp").write_bytes(b'{"name": "chat", "variants": [{"adap')
        (folder / ".other.json.def456.tmp").write_bytes(b"")
        assert await store.get_route("acme", "chat") == route("chat", 90, 10)
        assert await store.list_routes("acme") == [route("chat", 90, 10)]

    asyncio.run(scenario())


_WRITER = """
import asyncio, sys
from loraserve.config_store import EmbeddedConfigStore
from loraserve.routing import Route, Variant

async def main():
    store = EmbeddedConfigStore(sys.argv[1])
    i = 0
    while True:
        i += 1
        variants = tuple(Variant(adapter=f"a{j}", weight=i) for j in range(200))  # a few KB per write
        await store.put_route("acme", Route(name="chat", variants=variants))
        if i == 1:
            print("ready", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_process_killed_mid_write_leaves_a_whole_record(tmp_path):
    """SIGKILL a writer rewriting one record in a loop: the file always holds one complete version."""
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE) as writer:
        try:
            assert writer.stdout.readline().strip() == b"ready"
            time.sleep(0.3)
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
    stored = asyncio.run(EmbeddedConfigStore(tmp_path).get_route("acme", "chat"))
    weights = {v.weight for v in stored.variants}
    assert (
        len(stored.variants) == 200 and len(weights) == 1 and weights.pop() > 1
    )  # killed mid-loop, not idle
    assert (
        msgspec.json.decode((tmp_path / "routes" / "acme" / "chat.json").read_bytes(), type=Route) == stored
    )


# the cache


class FlakyBackend(EmbeddedConfigStore):
    """An embedded store whose backend calls fail while `down` is set, and that counts reads."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.down = False
        self.reads = 0  # backend calls that got through, writes included

    async def _io(self, fn, *args):
        if self.down:
            raise ConfigStoreUnavailable("backend down for the test")
        self.reads += 1
        return await super()._io(fn, *args)


def test_cache_serves_reads_from_memory_and_refreshes_after_changes(tmp_path):
    async def scenario():
        backend = FlakyBackend(tmp_path)
        async with CachedConfigStore(backend) as cached:
            await cached.put_route("acme", route("chat", 90, 10))
            backend.reads = 0
            for _ in range(5):
                assert await cached.get_route("acme", "chat") == route("chat", 90, 10)
                assert await cached.get_route("acme", "missing") is None  # misses are cached too
            assert backend.reads == 2
            await cached.put_route("acme", route("chat", 80, 20))  # read-your-writes
            assert await cached.get_route("acme", "chat") == route("chat", 80, 20)
            assert await cached.list_routes("acme") == [route("chat", 80, 20)]

    asyncio.run(scenario())


def test_cache_serves_last_known_config_while_backend_is_down(tmp_path):
    async def scenario():
        backend = FlakyBackend(tmp_path)
        async with CachedConfigStore(backend, retry_initial_s=0.01, retry_max_s=0.05) as cached:
            await cached.put_route("acme", route("chat", 90, 10))
            assert await cached.get_route("acme", "chat") == route("chat", 90, 10)
            await backend.put_route("acme", route("chat", 70, 30))  # stale now: the event marks it so
            backend.down = True
            assert await cached.get_route("acme", "chat") == route("chat", 90, 10)  # last known, no error
            assert not cached.healthy and "backend down" in cached.last_error
            assert cached.unhealthy_since is not None
            with pytest.raises(ConfigStoreUnavailable):
                await cached.get_route("acme", "never-cached")
            with pytest.raises(ConfigStoreUnavailable):
                await cached.put_route("acme", route("other", 1))
            backend.down = False

            async def recovered():
                return cached.healthy

            await eventually(recovered)  # the probe noticed, with no read needed
            assert cached.last_error is None and cached.unhealthy_since is None
            assert await cached.get_route("acme", "chat") == route("chat", 70, 30)

    asyncio.run(scenario())


def test_a_load_that_overlaps_an_invalidation_is_not_trusted(tmp_path):
    async def scenario():
        backend = FlakyBackend(tmp_path)
        await backend.put_route("acme", route("chat", 1))
        gate = asyncio.Event()
        real_get = backend.get_route

        async def slow_get(tenant, name):
            value = await real_get(tenant, name)
            await gate.wait()
            return value

        async with CachedConfigStore(backend) as cached:
            backend.get_route = slow_get
            reader = asyncio.create_task(cached.get_route("acme", "chat"))
            await asyncio.sleep(0.05)
            await backend.put_route(
                "acme", route("chat", 2)
            )  # event arrives while the old value is in flight
            gate.set()
            assert await reader == route("chat", 1)
            assert await cached.get_route("acme", "chat") == route("chat", 2)  # reloaded, not the stale copy

    asyncio.run(scenario())


# Redis across replicas and outages


def test_change_through_one_replica_reaches_the_others_cache_within_a_second(redis_server):
    async def scenario():
        prefix = f"test-{uuid.uuid4().hex[:8]}"
        a = await CachedConfigStore(RedisConfigStore(redis_server.url, prefix=prefix)).start()
        b = await CachedConfigStore(RedisConfigStore(redis_server.url, prefix=prefix)).start()
        try:
            await a.put_route("acme", route("chat", 90, 10))
            assert await b.get_route("acme", "chat") == route("chat", 90, 10)
            # b really caches: a silent write (no event) is not seen
            raw = redis.Redis.from_url(redis_server.url)
            await raw.hset(f"{prefix}:routes:acme", "chat", msgspec.json.encode(route("chat", 1, 1)))
            await raw.aclose()
            assert await b.get_route("acme", "chat") == route("chat", 90, 10)

            await a.put_route("acme", route("chat", 80, 20))

            async def b_sees_it():
                return await b.get_route("acme", "chat") == route("chat", 80, 20)

            assert await eventually(b_sees_it, timeout_s=1.0) < 1.0
            await a.delete_route("acme", "chat")

            async def b_sees_delete():
                return await b.get_route("acme", "chat") is None and await b.list_routes("acme") == []

            await eventually(b_sees_delete, timeout_s=1.0)
            key = api_key("sk-new", "acme")
            assert await b.get_key(key.key_hash) is None
            await a.put_key(key)

            async def b_sees_key():
                return await b.get_key(key.key_hash) == key

            await eventually(b_sees_key, timeout_s=1.0)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_redis_killed_serves_cached_config_and_recovers_after_restart(redis_server_factory):
    server = redis_server_factory()

    async def scenario():
        backend = RedisConfigStore(server.url, retry_initial_s=0.05, retry_max_s=0.2, connect_timeout_s=0.5)
        async with CachedConfigStore(backend, retry_initial_s=0.05, retry_max_s=0.2) as cached:
            await cached.put_route("acme", route("chat", 90, 10))
            key = api_key("sk-alice", "acme", "admin")
            await cached.put_key(key)
            assert await cached.get_route("acme", "chat") == route("chat", 90, 10)
            assert await cached.get_key(key.key_hash) == key
            assert cached.healthy

            server.stop()

            async def unhealthy():
                return not cached.healthy

            await eventually(unhealthy, timeout_s=3.0)
            assert "unreachable" in cached.last_error and "127.0.0.1" in cached.last_error
            started = time.monotonic()
            for _ in range(20):  # requests keep being answered, quickly
                assert await cached.get_route("acme", "chat") == route("chat", 90, 10)
                assert await cached.get_key(key.key_hash) == key
            assert time.monotonic() - started < 1.0
            with pytest.raises(ConfigStoreUnavailable, match="unreachable"):
                await cached.get_route("acme", "never-seen")
            with pytest.raises(ConfigStoreUnavailable):
                await cached.ping()
            assert not cached.healthy

            server.start()

            async def healthy():
                return cached.healthy

            await eventually(healthy, timeout_s=5.0)
            assert cached.last_error is None
            assert await cached.get_route("acme", "chat") == route("chat", 90, 10)
            await cached.put_route("acme", route("chat", 50, 50))
            assert await cached.get_route("acme", "chat") == route("chat", 50, 50)

    asyncio.run(scenario())


def test_unreachable_redis_at_start_reports_and_then_connects(redis_server_factory):
    server = redis_server_factory()
    server.stop()

    async def scenario():
        backend = RedisConfigStore(server.url, retry_initial_s=0.05, retry_max_s=0.2, connect_timeout_s=0.5)
        async with CachedConfigStore(backend, retry_initial_s=0.05, retry_max_s=0.2) as cached:
            assert not cached.healthy and "unreachable" in cached.last_error
            with pytest.raises(ConfigStoreUnavailable):
                await cached.list_routes("acme")
            server.start()

            async def healthy():
                return cached.healthy

            await eventually(healthy, timeout_s=5.0)
            assert await cached.list_routes("acme") == []

    asyncio.run(scenario())


# URLs


@pytest.mark.parametrize(
    "url, kind, where",
    [
        (None, EmbeddedConfigStore, Path(".loraserve/config")),
        ("", EmbeddedConfigStore, Path(".loraserve/config")),
        ("file:///var/lib/loraserve", EmbeddedConfigStore, Path("/var/lib/loraserve")),
        ("file://./state/config", EmbeddedConfigStore, Path("state/config")),
        ("/srv/config", EmbeddedConfigStore, Path("/srv/config")),
        ("redis://localhost:6379/0", RedisConfigStore, "redis://localhost:6379/0"),
        ("rediss://user:pw@cache:6380/2", RedisConfigStore, "rediss://user:pw@cache:6380/2"),
    ],
)
def test_open_config_store(url, kind, where):
    store = open_config_store(url)
    assert isinstance(store, kind) and isinstance(store, ConfigStore)
    assert (store.root if kind is EmbeddedConfigStore else store.url) == where


@pytest.mark.parametrize("url", ["s3://bucket/x", "http://example.com", "file://otherhost/dir"])
def test_open_config_store_refuses_unknown_urls(url):
    with pytest.raises(ValueError, match="config store URL"):
        open_config_store(url)


def test_redact_url_hides_the_password():
    assert redact_url("redis://user:hunter2@cache:6380/1") == "redis://user:***@cache:6380/1"
    assert redact_url("redis://:hunter2@cache/0") == "redis://:***@cache/0"
    assert redact_url("redis://cache:6379/0") == "redis://cache:6379/0"
