"""The store's limits as an operator sets them and a client meets them: the adapter cache's flags and
environment variables, an upload that meets a full disk (507 with OpenAI's body, nothing left behind),
and /ready's `degraded` entry while the adapter cache is out of room."""

from __future__ import annotations

import asyncio
import errno
import time

import pytest
from api_env import ADMIN_A, FakeEngine, bearer, build_app, build_services, upload
from litestar.testing import TestClient
from loraserve.bootstrap import store_config
from loraserve.cli import build_parser, settings_from_args
from loraserve.ops.readiness import ADAPTER_CACHE_FULL, Readiness

import adapters_store.file_writers as file_writers
from adapters_store.cache_room import NoRoomMark


def settings(argv, env=None):
    return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))


def test_cache_and_quota_flags_and_their_environment_variables():
    default = settings([])
    assert default.adapter_cache_max_bytes == 10 << 30 and default.adapter_cache_min_free_bytes == 0
    assert default.max_concurrent_uploads_per_tenant == 2 and default.max_routes_per_tenant == 1000
    env = {
        "LORASERVE_ADAPTER_CACHE_MAX_BYTES": "512MiB",
        "LORASERVE_ADAPTER_CACHE_MIN_FREE_BYTES": "2GiB",
        "LORASERVE_MAX_CONCURRENT_UPLOADS_PER_TENANT": "4",
        "LORASERVE_MAX_ROUTES_PER_TENANT": "10",
    }
    from_env = settings([], env)
    assert (from_env.adapter_cache_max_bytes, from_env.adapter_cache_min_free_bytes) == (512 << 20, 2 << 30)
    assert (from_env.max_concurrent_uploads_per_tenant, from_env.max_routes_per_tenant) == (4, 10)
    config = store_config(from_env)
    assert (config.cache_max_bytes, config.cache_min_free_bytes) == (512 << 20, 2 << 30)
    assert settings(["--adapter-cache-max-bytes", "3000000"], env).adapter_cache_max_bytes == 3_000_000


@pytest.mark.parametrize(
    "argv, env, words",
    [
        (["--adapter-cache-max-bytes", "lots"], {}, ["--adapter-cache-max-bytes", "10GiB"]),
        ([], {"LORASERVE_ADAPTER_CACHE_MAX_BYTES": "-1"}, ["LORASERVE_ADAPTER_CACHE_MAX_BYTES"]),
        (["--adapter-cache-max-bytes", "0"], {}, ["--adapter-cache-max-bytes must be an integer >= 1"]),
        (["--max-concurrent-uploads-per-tenant", "0"], {}, ["--max-concurrent-uploads-per-tenant"]),
        (["--max-routes-per-tenant", "0"], {}, ["--max-routes-per-tenant"]),
    ],
)
def test_bad_values_name_the_flag(argv, env, words, capsys):
    with pytest.raises(SystemExit):
        parser = build_parser(env)
        args = parser.parse_args(["serve", *argv])
        try:
            settings_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
    err = capsys.readouterr().err
    for word in words:
        assert word in err


@pytest.fixture
def services(tmp_path):
    return build_services(tmp_path, engine=FakeEngine())


def test_an_upload_that_meets_a_full_disk_is_507_and_leaves_nothing(
    services, peft_adapters, tmp_path, monkeypatch
):
    real_open = open

    class FullDisk:
        def __init__(self, file, mode):
            self.file = real_open(file, mode)

        def write(self, data):
            raise OSError(errno.ENOSPC, f"No space left on device: {tmp_path}")

        def close(self):
            self.file.close()

        @property
        def closed(self):
            return self.file.closed

    monkeypatch.setattr(file_writers, "open", FullDisk, raising=False)
    with TestClient(build_app(services)) as client:
        response = upload(client, "a", peft_adapters["qv"])
        listed = client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"]
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
    assert "disk is full" in error["message"] and str(tmp_path) not in response.text
    assert listed == []
    assert list((tmp_path / "staging").iterdir()) == [], "the staging folder goes with the request"


def test_ready_reports_an_adapter_cache_out_of_room_and_its_recovery(services):
    """Out of room is this replica's trouble, not the fleet's: /ready stays 200 and says so under `degraded`
    (in words with no path), until an insertion succeeds or the space comes back."""
    mark = NoRoomMark(services.disk_cache.directory)
    readiness = Readiness(interval_s=0.0)

    async def settled():
        await readiness.check(services)  # starts the background check
        for _ in range(200):
            await asyncio.sleep(0.01)
            if readiness._check is not None and readiness._check.done():
                break
        return await readiness.check(services)

    async def scenario():
        before = await settled()
        mark.set(1 << 62, 0)  # an insertion found no room for more than any disk holds
        during = await settled()
        mark.clear()  # then one succeeded
        after = await settled()
        readiness.close()
        return before, during, after

    before, during, after = asyncio.run(scenario())
    assert ADAPTER_CACHE_FULL not in before.degraded
    assert during.ready and ADAPTER_CACHE_FULL in during.degraded
    assert ADAPTER_CACHE_FULL not in after.degraded
    assert "/" not in ADAPTER_CACHE_FULL
    with TestClient(build_app(services)) as client:  # the route answers with the same words
        mark.set(1 << 62, 0)
        client.get("/ready")
        deadline = time.monotonic() + 5
        while ADAPTER_CACHE_FULL not in (body := client.get("/ready").json()).get("degraded", []):
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        assert body["ready"] is True
