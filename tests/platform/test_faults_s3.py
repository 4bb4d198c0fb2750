"""Fault injection: S3 (moto on loopback) behind a proxy that refuses, hangs and cuts connections.

The whole server runs in-process (real engine on a tiny model, real S3 store, real HTTP app); only
the network between the store and S3 misbehaves. During each outage:
- requests for adapters already resident (GPU slot or CPU tier) are all served, none waits on S3;
- /health and /ready answer at once;
- a request for an adapter never loaded gets a clear 503 within a few seconds, naming no endpoint or bucket;
and once S3 is back, that adapter is served again. Timeouts are shrunk so the test takes seconds; the
production defaults scale them (StoreConfig, AdapterLookup).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import httpx
import pytest
from app_fixtures import make_text_model, open_test_services
from factories import make_adapter
from fault_proxy import FaultProxy
from fixtures_s3 import s3_admin, s3_bucket, s3_endpoint  # noqa: F401 (fixtures)
from loraserve.adapter_lookup import AdapterLookup
from loraserve.app import create_app
from loraserve.settings import ServerSettings

from adapters_store import StoreConfig, StoreUnavailable
from adapters_store.s3 import S3Store

REQUESTS_PER_FAULT = 12
REQUEST_TIMEOUT_S = 8.0  # a request slower than this counts as hung
PROBE_LIMIT_S = 1.0
LOOKUP_TIMEOUT_S = 2.0  # a request that waited on S3 would take at least this long
HOT_LIMIT_S = 1.5  # so resident requests finishing within this did not wait on S3
COLD_LIMIT_S = LOOKUP_TIMEOUT_S + 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("faults-s3") / "model")


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-s3-adapters")
    return {
        name: make_adapter(model_dir, root / name, seed=seed, r=4, lora_alpha=8, target_modules=["q_proj"])
        for seed, name in enumerate(["hot1", "hot2", "cold"])
    }


async def timed(call) -> tuple[httpx.Response | None, float]:
    """The response (None if it took longer than REQUEST_TIMEOUT_S) and the seconds it took."""
    started = time.monotonic()
    try:
        return await asyncio.wait_for(call, REQUEST_TIMEOUT_S), time.monotonic() - started
    except TimeoutError:
        return None, time.monotonic() - started


def completion(model: str) -> dict:
    return {"model": model, "prompt": [4, 5, 6], "max_tokens": 3, "temperature": 0}


@pytest.mark.slow
def test_s3_outages_spare_resident_adapters(tmp_path, model_dir, adapter_dirs, s3_endpoint, s3_bucket):  # noqa: F811
    report: list[tuple[str, int, int, int, int, str]] = []

    async def main():
        with FaultProxy(urlparse(s3_endpoint).port) as proxy:
            store_config = StoreConfig(
                url=f"s3://{s3_bucket}/faults",
                endpoint_url=proxy.url,
                max_lora_rank=16,
                retries=2,
                backoff_s=0.05,
                max_backoff_s=0.2,
                retry_deadline_s=1.0,
                connect_timeout_s=0.5,
                read_timeout_s=0.5,
            )
            async with open_test_services(tmp_path, model_dir, store_config=store_config) as services:
                services.adapter_lookup = AdapterLookup(ttl_s=0.3, timeout_s=LOOKUP_TIMEOUT_S, retry_s=0.5)
                app = create_app(ServerSettings(), services=services)
                transport = httpx.ASGITransport(app=app)
                async with (
                    app.lifespan(),
                    httpx.AsyncClient(transport=transport, base_url="http://t") as client,
                ):
                    await scenario(client, services, proxy)

    async def scenario(client, services, proxy):
        for name, folder in adapter_dirs.items():
            await asyncio.to_thread(services.adapter_store.put, "default", name, folder)
        for model in ("hot1", "hot2"):  # loads them: GPU slots (max_loras 2) and the CPU tier
            response = await client.post("/v1/completions", json=completion(model))
            assert response.status_code == 200, response.text
        await wait_resident(services, {"default/hot1@1", "default/hot2@1"})
        for mode in ("refuse", "hang", "cut"):
            proxy.set_mode(mode)
            faults_before = proxy.faults
            await asyncio.sleep(0.4)  # past the lookup TTL: every cached answer is due for a refresh
            hot = await asyncio.gather(
                *(
                    timed(client.post("/v1/completions", json=completion(["hot1", "hot2", "hot1@1"][i % 3])))
                    for i in range(REQUESTS_PER_FAULT)
                )
            )
            probes = [await timed(client.get(path)) for path in ("/health", "/ready", "/health", "/ready")]
            cold, cold_s = await timed(client.post("/v1/completions", json=completion("cold")))
            scrape = await client.get("http://t:8001/metrics")  # the metrics listener of ServerSettings()
            proxy.set_mode("pass")
            lost = sum(1 for r, _ in hot if r is not None and r.status_code != 200)
            hung = sum(1 for r, _ in hot if r is None)
            report.append(
                (mode, REQUESTS_PER_FAULT + 1, lost, hung, proxy.faults - faults_before, f"{cold_s:.2f}")
            )
            assert (lost, hung) == (0, 0), [r.text if r is not None else "hung" for r, _ in hot]
            assert max(s for _, s in hot) < HOT_LIMIT_S, f"a resident request waited on S3 ({mode})"
            for response, seconds in probes:
                assert response is not None and response.status_code == 200 and seconds < PROBE_LIMIT_S
            assert "loraserve_adapter_store_up 0.0" in scrape.text  # where the outage shows
            assert cold is not None and cold.status_code == 503, (mode, cold and cold.text)
            assert cold_s < COLD_LIMIT_S, f"the cold request took {cold_s:.1f} s with S3 {mode}"
            error = cold.json()["error"]
            assert error["code"] == "store_unavailable"
            assert str(proxy.port) not in cold.text and "faults" not in cold.text and "s3" not in cold.text
            await asyncio.sleep(0.6)  # the lookup leaves the store alone for retry_s after a failure
        recovered = await client.post("/v1/completions", json=completion("cold"))
        assert recovered.status_code == 200, recovered.text
        assert recovered.json()["model"] == "cold@1"
        assert "loraserve_adapter_store_up 1.0" in (await client.get("http://t:8001/metrics")).text

    asyncio.run(main())
    print("\nS3 fault injection: mode, requests, lost, hung, faulted connections, cold 503 seconds")
    for row in report:
        print("  " + ", ".join(map(str, row)))


async def wait_resident(services, adapter_ids: set[str], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not adapter_ids <= services.engine.stats().resident_adapters:
        assert time.monotonic() < deadline, services.engine.stats().resident_adapters
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("mode", ["hang", "refuse", "cut"])
def test_every_store_call_is_bounded_in_time(tmp_path, model_dir, adapter_dirs, s3_endpoint, s3_bucket, mode):  # noqa: F811
    """Retries stop at retry_deadline_s: with 10 retries of 0.5 s reads a hung S3 would hold a call ~6 s."""
    with FaultProxy(urlparse(s3_endpoint).port) as proxy:
        config = StoreConfig(
            url=f"s3://{s3_bucket}/bounded",
            endpoint_url=proxy.url,
            retries=10,
            backoff_s=0.05,
            max_backoff_s=0.1,
            retry_deadline_s=1.0,
            connect_timeout_s=0.5,
            read_timeout_s=0.5,
        )
        store = S3Store(s3_bucket, "bounded", config)
        # botocore builds its endpoint, signer and handlers on a client's first call (a second or more on a
        # loaded 2-core machine): make that call through a healthy proxy, so the clock below times retries only.
        store.check()
        proxy.set_mode(mode)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            store.get("default", "anything")
        took = time.monotonic() - started
    assert took < 1.0 + 0.5 + 0.5, f"{took:.1f} s"
    assert caught.value.reason  # what failed, for the log
