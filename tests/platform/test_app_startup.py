"""The server answers while it loads: /health 200, /ready 503 naming the step, other requests 503
`model_not_ready`; /ready turns 200 once the model is loaded, and a start that fails stops the server.

`open_services` is swapped for one that waits on an event before it builds the real services (a tiny
model), so the loading window lasts as long as the test needs.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from app_fixtures import make_text_model, open_test_services
from loraserve import app as app_module
from loraserve.app import create_app, shutdown_of
from loraserve.settings import ServerSettings

STEP = "loading the model in the engine core process"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("startup") / "model")


@pytest.mark.slow
def test_probes_answer_while_the_model_loads(tmp_path, model_dir, monkeypatch):
    loaded = asyncio.Event()  # made inside asyncio.run below

    @contextlib.asynccontextmanager
    async def slow_open_services(settings, progress, role=None):
        progress(STEP)
        await loaded.wait()
        async with open_test_services(tmp_path, model_dir) as services:
            yield services

    monkeypatch.setattr(app_module, "open_services", slow_open_services)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}

    async def main():
        nonlocal loaded
        loaded = asyncio.Event()
        app = create_app(ServerSettings(model=str(model_dir), served_model_name="tiny", state_dir=tmp_path))
        transport = httpx.ASGITransport(app=app)
        async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            loading = [
                await client.get("/health"),
                await client.get("/ready"),
                await client.get("/v1/models"),
                await client.post("/v1/completions", json=body),
            ]
            loaded.set()
            for _ in range(600):  # the engine core starts in its own process
                if (await client.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            served = [await client.get("/ready"), await client.post("/v1/completions", json=body)]
        return loading, served

    (health, ready, models, completion), (ready_after, completion_after) = asyncio.run(main())
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ready.status_code == 503
    assert ready.json() == {"ready": False, "model": "tiny", "reasons": [f"model not loaded yet: {STEP}"]}
    for refused in (models, completion):
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "model_not_ready"
    assert ready_after.status_code == 200 and ready_after.json()["ready"] is True
    assert completion_after.status_code == 200, completion_after.text


def test_a_failed_start_stops_the_server(tmp_path, monkeypatch):
    @contextlib.asynccontextmanager
    async def broken_open_services(settings, progress, role=None):
        raise ValueError("--adapter-store: bucket 'x' does not exist")
        yield  # pragma: no cover

    monkeypatch.setattr(app_module, "open_services", broken_open_services)

    async def main():
        app = create_app(ServerSettings(state_dir=tmp_path))
        transport = httpx.ASGITransport(app=app)
        async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for _ in range(100):
                if shutdown_of(app).fatal_error is not None:
                    break
                await asyncio.sleep(0.01)
            return shutdown_of(app).fatal_error, await client.get("/ready")

    fatal, ready = asyncio.run(main())
    assert fatal == "start-up failed: --adapter-store: bucket 'x' does not exist"  # the CLI exits with 1
    assert ready.status_code == 503
