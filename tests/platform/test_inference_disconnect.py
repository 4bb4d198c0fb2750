"""A client that hangs up aborts its engine request: the KV blocks are freed and the tenant's lease released.

Driven at the ASGI level, so the test decides exactly when `http.disconnect` arrives.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from app_fixtures import make_text_model, open_test_services
from loraserve.app import create_app
from loraserve.settings import ServerSettings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("disconnect") / "model")


def scope_for(path: str, body: bytes) -> dict:
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
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }


async def call_and_hang_up(app, path: str, body: dict, hang_up_when) -> list[dict]:
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

    await asyncio.wait_for(app(scope_for(path, raw), receive, send), timeout=30)
    return sent


async def engine_idle(services) -> bool:
    for _ in range(500):
        stats = services.engine.stats()  # the core publishes a fresh snapshot at most 50 ms apart
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return True
        await asyncio.sleep(0.01)
    return False


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
                )

    sent, idle, in_flight, generated = asyncio.run(main())
    assert idle, "the engine kept the request (or its KV blocks) after the client left"
    assert in_flight == 0
    assert generated < 110  # stopped early, not run to completion
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in text
    if stream:
        assert b"data: " in text
