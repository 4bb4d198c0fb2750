"""The serving warm-up (ops/serving_warmup.py): before /ready turns 200, a small batch of real requests
ran through this process's own request path; they count in no request metric, run as the reserved
tenant `_warmup` (the engine's per-tenant series show it by that name), and `--no-serving-warmup`
turns it off. The multi-process case (each front end warms itself) is in
tests/e2e/test_e2e_api_servers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import pytest
from app_fixtures import make_text_model, open_test_services
from loraserve import app as app_module
from loraserve.app import create_app
from loraserve.cli import build_parser, settings_from_args
from loraserve.ops.readiness import WARMING_UP
from loraserve.ops.serving_warmup import WARMUP_TENANT, asgi_call
from loraserve.settings import ServerSettings

DONE = "serving warm-up of the server done: 4 requests"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("serving-warmup") / "model")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def start(tmp_path, model_dir, monkeypatch, **settings):
    """Serve the tiny model in process until /ready is 200; (warm-up log lines then, /ready reasons met on
    the way, the services' metrics text)."""
    built = []

    @contextlib.asynccontextmanager
    async def test_services(settings, progress, role=None):
        async with open_test_services(tmp_path, model_dir) as services:
            built.append(services)
            yield services

    monkeypatch.setattr(app_module, "open_services", test_services)

    async def main():
        app = create_app(
            ServerSettings(model=str(model_dir), served_model_name="tiny", state_dir=tmp_path, **settings)
        )
        transport = httpx.ASGITransport(app=app)
        reasons: set[str] = set()
        async with app.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for _ in range(1200):
                ready = await client.get("/ready")
                if ready.status_code == 200:
                    logged = [line for line in lines.lines if "serving warm-up" in line]
                    return logged, reasons, built[0].metrics.render().decode()
                reasons.update(ready.json()["reasons"])
                await asyncio.sleep(0.05)
        raise AssertionError("not ready in time")

    lines, logger = Lines(), logging.getLogger("loraserve")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        return asyncio.run(main())
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def tenant_series(metrics: str, tenant: str) -> list[str]:
    return [line for line in metrics.splitlines() if f'tenant="{tenant}"' in line]


def test_ready_only_after_the_warmup_ran_and_it_is_no_user_traffic(tmp_path, model_dir, monkeypatch):
    logged, reasons, metrics = start(tmp_path, model_dir, monkeypatch)
    assert len(logged) == 1 and logged[0].startswith(DONE), logged  # before /ready was 200
    assert "streaming chat completion" in logged[0] and "streaming completion" in logged[0]
    assert reasons <= {WARMING_UP} or any(r.startswith("model not loaded") for r in reasons), reasons
    # No user-visible request metric counts it; the engine's per-tenant series name it `_warmup`.
    finished = [
        line
        for line in metrics.splitlines()
        if line.startswith("vllm:request_success_total{") and not line.endswith(" 0.0")
    ]
    assert finished == [], finished
    assert 'loraserve_tenant_requests_total{tenant="_warmup"} 4.0' in metrics, tenant_series(
        metrics, WARMUP_TENANT
    )


@pytest.mark.slow
def test_no_serving_warmup_turns_it_off(tmp_path, model_dir, monkeypatch):
    logged, reasons, metrics = start(tmp_path, model_dir, monkeypatch, serving_warmup=False)
    assert logged == [] and WARMING_UP not in reasons
    assert tenant_series(metrics, WARMUP_TENANT) == []


def test_the_flag_and_its_environment_variable():
    def parse(argv, env=None):
        return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))

    assert parse([]).serving_warmup is True and parse([]).serving_warmup_timeout == 60.0
    assert parse(["--no-serving-warmup"]).serving_warmup is False
    assert parse([], {"LORASERVE_SERVING_WARMUP": "false"}).serving_warmup is False
    assert parse(["--serving-warmup-timeout", "5"]).serving_warmup_timeout == 5.0
    with pytest.raises(ValueError, match="--serving-warmup-timeout"):
        parse(["--serving-warmup-timeout", "0"])


@pytest.mark.slow
def test_a_client_cannot_pass_for_the_warmup(tmp_path, model_dir):
    """The warm-up's identity lives in the ASGI scope, which only the server writes: a header, query or
    body field of the same name is an ordinary request (here: 401, the server has keys)."""

    async def main():
        keys = {"sk-real-0123456789abcdef": {"tenant": "acme", "role": "user"}}
        async with open_test_services(tmp_path, model_dir, api_keys=keys) as services:
            app = create_app(ServerSettings(served_model_name="tiny"), services=services)
            async with app.lifespan():
                marked = await asgi_call(app, "POST", "/v1/completions", b'{"model":"tiny","prompt":"a"}')
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                    forged = await client.post(
                        "/v1/completions",
                        json={"model": "tiny", "prompt": "a", "loraserve.serving_warmup": True},
                        headers={"loraserve.serving_warmup": "1"},
                    )
            return marked, forged

    (status, _), forged = asyncio.run(main())
    assert status == 200
    assert forged.status_code == 401
