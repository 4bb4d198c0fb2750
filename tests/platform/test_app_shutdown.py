"""Draining: new requests and /ready get 503, in-flight streams finish within the timeout, and the rest
end with an error event and `data: [DONE]` instead of a cut connection."""

from __future__ import annotations

import asyncio

import pytest
from app_fixtures import make_text_model
from test_inference_completions import run, sse_events

LONG = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 110,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("shutdown") / "model")


async def start_stream(client, services, body):
    """Post `body` and return once its first token exists, so the SSE headers are (about to be) sent.

    Waiting only for the request to be tracked is not enough: a drain that aborts it before its first
    token makes the handler answer a plain 503 instead of a stream, which is right but not this test.
    """
    task = asyncio.create_task(client.post("/v1/completions", json=body))
    for _ in range(10000):
        if any(generation.has_tokens for generation in services.shutdown.in_flight):
            return task
        await asyncio.sleep(0.001)
    raise AssertionError("the stream never produced a token")


@pytest.mark.slow
@pytest.mark.parametrize("timeout_s, finishes", [(0.0, False), (30.0, True)])
def test_drain_refuses_new_work_and_ends_streams_properly(tmp_path, model_dir, timeout_s, finishes):
    async def scenario(client, services):
        stream = await start_stream(client, services, LONG)
        drain = asyncio.create_task(services.shutdown.drain(timeout_s))
        await asyncio.sleep(0)
        refused = await client.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 2})
        ready = await client.get("/ready")
        health = await client.get("/health")
        aborted = await drain
        return await stream, refused, ready, health, aborted

    stream, refused, ready, health, aborted = run(tmp_path, model_dir, scenario)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert ready.status_code == 503 and any("shutting down" in r for r in ready.json()["reasons"])
    assert health.status_code == 200
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    if finishes:
        assert aborted == 0
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert aborted == 1
        assert events[-2]["error"]["code"] == "server_shutting_down"
        assert sum(len(c["text"]) > 0 for e in events[:-2] for c in e["choices"]) < 110
