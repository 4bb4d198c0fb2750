"""A dead engine core: /health and /ready answer 503, new requests get 503 with OpenAI's error body,
and the server is told to exit non-zero (the CLI does on `Shutdown.fatal_error`)."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
from app_fixtures import make_text_model, open_test_services
from loraserve.app import create_app, shutdown_of
from loraserve.settings import ServerSettings
from processes import kill_quietly, wait_gone


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("core-death") / "model")


@pytest.mark.slow
def test_killed_core_turns_health_ready_and_requests_into_503(tmp_path, model_dir):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}

    async def main():
        async with open_test_services(tmp_path, model_dir) as services:
            app = create_app(ServerSettings(), services=services)
            transport = httpx.ASGITransport(app=app)
            async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                before = (
                    (await client.get("/health")).status_code,
                    (await client.post("/v1/completions", json=body)),
                )
                pid = services.engine.core_pid
                try:
                    os.kill(pid, signal.SIGKILL)
                    assert wait_gone(pid, 10)
                    for _ in range(100):  # the receiver thread notices within its poll interval
                        if services.engine.dead_error is not None:
                            break
                        await asyncio.sleep(0.05)
                    return (
                        before,
                        await client.get("/health"),
                        await client.get("/ready"),
                        await client.post("/v1/completions", json=body),
                        await client.post("/v1/completions", json={**body, "stream": True}),
                        shutdown_of(app).fatal_error,
                    )
                finally:
                    kill_quietly(pid)

    (health_before, ok), health, ready, refused, refused_stream, fatal = asyncio.run(main())
    assert health_before == 200 and ok.status_code == 200
    assert health.status_code == 503 and "engine stopped" in health.json()["reason"]
    assert ready.status_code == 503 and any("engine stopped" in r for r in ready.json()["reasons"])
    for response in (refused, refused_stream):
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "engine_dead" and error["type"] == "service_unavailable"
        assert "engine stopped" in error["message"] and "/" not in error["message"]  # no paths leak
    assert fatal is not None and "SIGKILL" in fatal
