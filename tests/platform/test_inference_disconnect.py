"""A client that hangs up aborts its engine request: the KV blocks are freed and the tenant's lease released,
also before the first token (the request never runs), and `vllm:request_success_total` counts it as
`abort`; a request the engine fails counts as `error`.

Driven at the ASGI level, so the test decides exactly when `http.disconnect` arrives.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from app_fixtures import make_text_model, open_test_services
from factories import make_adapter
from loraserve.app import create_app
from loraserve.settings import ServerSettings
from prometheus_client.parser import text_string_to_metric_families

METRICS_URL = "http://testserver:8001/metrics"  # the metrics listener (ServerSettings' port + 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("disconnect") / "model")


def scope_for(path: str, body: bytes, headers: tuple = ()) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }


async def call_and_hang_up(app, path: str, body: dict, hang_up_when, headers: tuple = ()) -> list[dict]:
    """Send `body`, then answer `receive()` with http.disconnect once `hang_up_when(sent)` holds."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        while not hang_up_when(sent):
            await asyncio.sleep(0.002)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(scope_for(path, raw, headers), receive, send), timeout=60)
    return sent


async def finished_reasons(app) -> dict[str, float]:
    """vllm:request_success_total by finished_reason, scraped from the metrics listener."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        text = (await c.get(METRICS_URL)).text
    return {
        s.labels["finished_reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total"
    }


async def engine_idle(services) -> bool:
    for _ in range(500):
        stats = services.engine.stats()  # the core publishes a fresh snapshot at most 50 ms apart
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request_and_frees_kv_blocks(tmp_path, model_dir, stream):
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 110,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }

    def body_chunks(sent):
        return [m for m in sent if m["type"] == "http.response.body" and m.get("body")]

    async def main():
        async with open_test_services(tmp_path, model_dir) as services:
            app = create_app(ServerSettings(), services=services)
            async with app.lifespan():
                if stream:

                    def hang_up(sent):  # after two chunks of a 110-token stream
                        return len(body_chunks(sent)) >= 2
                else:

                    def hang_up(sent):  # once the engine is generating
                        return services.engine.stats().num_generation_tokens >= 3

                sent = await call_and_hang_up(app, "/v1/completions", body, hang_up)
                return (
                    sent,
                    await engine_idle(services),
                    services.limiter.in_flight("default"),
                    services.engine.stats().num_generation_tokens,
                    await finished_reasons(app),
                )

    sent, idle, in_flight, generated, reasons = asyncio.run(main())
    assert idle, "the engine kept the request (or its KV blocks) after the client left"
    assert in_flight == 0
    assert reasons == {"stop": 0, "length": 0, "abort": 1, "error": 0}
    assert generated < 110  # stopped early, not run to completion
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in text
    if stream:
        assert b"data: " in text


KEYS = {"sk-alice": {"tenant": "alice", "role": "admin"}, "sk-bob": {"tenant": "bob", "role": "admin"}}
FILLER_TOKENS = 80


@pytest.mark.slow
def test_a_stream_whose_client_leaves_before_its_first_token_never_runs(tmp_path, model_dir):
    """One sequence at a time: bob's long request runs, alice's stream waits in the engine's queue, and
    her client leaves. The engine drops her request at once (it leaves the queue while bob's still
    runs), her lease is back at once, and it is never prefilled or decoded later."""
    alice = ((b"authorization", b"Bearer sk-alice"),)
    bob = {"authorization": "Bearer sk-bob"}

    async def main():
        async with open_test_services(tmp_path, model_dir, api_keys=KEYS, max_num_seqs=1) as services:
            app = create_app(ServerSettings(), services=services)
            async with (
                app.lifespan(),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://testserver"
                ) as client,
            ):
                filler_body = {
                    "model": "tiny",
                    "prompt": [4, 5, 6],
                    "max_tokens": FILLER_TOKENS,
                    "ignore_eos": True,
                }
                filler = asyncio.create_task(client.post("/v1/completions", json=filler_body, headers=bob))
                while services.engine.stats().num_running < 1:
                    await asyncio.sleep(0.005)
                body = {"model": "tiny", "prompt": [7, 8, 9, 10, 11], "max_tokens": 8, "stream": True}

                def queued(sent):  # alice's request waits in the engine for bob's sequence
                    return services.engine.stats().num_waiting >= 1

                sent = await call_and_hang_up(app, "/v1/completions", body, queued, alice)
                left = time.monotonic()
                lease_back = services.limiter.in_flight("alice")
                while services.engine.stats().num_waiting and time.monotonic() - left < 20:
                    await asyncio.sleep(0.005)
                dropped_after = time.monotonic() - left
                still_running = services.engine.stats().num_running == 1 and not filler.done()
                filler_response = await filler
                idle = await engine_idle(services)
                stats = services.engine.stats()
                return (
                    sent,
                    lease_back,
                    dropped_after,
                    still_running,
                    filler_response,
                    idle,
                    stats,
                    await finished_reasons(app),
                )

    sent, lease_back, dropped_after, still_running, filler, idle, stats, reasons = asyncio.run(main())
    assert lease_back == 0  # released when the client left, not when the request would have run
    assert dropped_after < 20 and still_running, "the engine kept the request queued after the client left"
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"data: " not in text  # no stream was ever started
    assert filler.status_code == 200 and idle
    # Only bob's request was ever prefilled and decoded.
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (3, FILLER_TOKENS)
    (alice_stats,) = [t for t in stats.tenants if t.tenant == "alice"] or [None]
    assert alice_stats is None or alice_stats.num_prompt_tokens == 0
    assert reasons == {"stop": 0, "length": 1, "abort": 1, "error": 0}


@pytest.mark.slow
def test_a_request_the_engine_fails_counts_as_error(tmp_path, model_dir):
    adapter = make_adapter(model_dir, tmp_path / "a", seed=9, r=4, lora_alpha=8, target_modules=["q_proj"])

    async def main():
        async with open_test_services(tmp_path, model_dir) as services:
            services.adapter_store.put("default", "broken", adapter)
            (stored,) = (tmp_path / "adapters").rglob("adapter_model.safetensors")
            stored.write_bytes(stored.read_bytes()[:-8] + b"\x00" * 8)  # its sha256 no longer matches
            app = create_app(ServerSettings(), services=services)
            async with (
                app.lifespan(),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://testserver"
                ) as client,
            ):
                body = {"model": "broken", "prompt": [4, 5, 6], "max_tokens": 2, "n": 2}
                failed = await client.post("/v1/completions", json=body)
                streamed = await client.post("/v1/completions", json={**body, "n": 1, "stream": True})
                return failed, streamed, await finished_reasons(app)

    failed, streamed, reasons = asyncio.run(main())
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "generation_failed"
    assert streamed.status_code == 503  # failed before its first token: a plain error, not a stream
    assert reasons == {"stop": 0, "length": 0, "abort": 0, "error": 3}  # n = 2, then one more
