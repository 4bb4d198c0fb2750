"""Token-rate limits (429 + Retry-After), GET /v1/usage (the caller's tenant only) and the per-tenant
metrics, through the real app and engine; the limiter's window on a fake clock."""

from __future__ import annotations

import asyncio

import pytest
from app_fixtures import make_text_model
from loraserve.tenancy import Principal, TokenRateLimiter, TooManyRequests, parse_api_keys
from loraserve.tenancy.errors import InvalidKeysFile
from test_inference_completions import run

ALICE = {"authorization": "Bearer sk-alice"}
ALICE_USER = {"authorization": "Bearer sk-alice-user"}
BOB = {"authorization": "Bearer sk-bob"}
KEYS = {
    "sk-alice": {"tenant": "alice", "role": "admin", "weight": 2, "max_tokens_per_minute": 30},
    "sk-alice-user": {"tenant": "alice", "role": "user", "weight": 2, "max_tokens_per_minute": 30},
    "sk-bob": {"tenant": "bob", "role": "admin"},
}
PROMPT = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("fair-share") / "model")


async def settled(services):
    """Wait until the engine's published snapshot shows it idle: then it counts every finished step."""
    for _ in range(500):
        stats = services.engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not go idle")


def completion(max_tokens=8):
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_a_tenant_over_its_tokens_per_minute_gets_429_with_retry_after(tmp_path, model_dir):
    async def scenario(client, services):
        served = [await client.post("/v1/completions", json=completion(), headers=ALICE) for _ in range(2)]
        refused = await client.post("/v1/completions", json=completion(), headers=ALICE_USER)
        too_large = await client.post("/v1/completions", json=completion(max_tokens=40), headers=ALICE)
        other = await client.post("/v1/completions", json=completion(), headers=BOB)
        await settled(services)
        metrics = await client.get("http://testserver:8001/metrics")  # the metrics listener, not tenants
        return served, refused, too_large, other, metrics, services

    served, refused, too_large, other, metrics, services = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert [r.status_code for r in served] == [200, 200]  # 5 + 8 tokens each: 26 of 30
    assert refused.status_code == 429  # 26 + 13 > 30, shared by the tenant's two keys
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "tokens per minute" in error["message"] and "bob" not in error["message"]
    assert too_large.status_code == 429 and "lower max_tokens" in too_large.json()["error"]["message"]
    assert other.status_code == 200  # bob has no limit, and alice's does not touch him
    assert services.limiter.in_flight("alice") == 0  # refused requests released their concurrency lease
    text = metrics.text
    assert 'loraserve_tenant_rate_limited_total{limit="tokens",tenant="alice"} 2.0' in text
    assert 'loraserve_tenant_prompt_tokens_total{tenant="alice"} 10.0' in text
    assert 'loraserve_tenant_generation_tokens_total{tenant="bob"} 8.0' in text
    assert 'loraserve_tenant_weight{tenant="alice"} 2.0' in text


def test_usage_reports_the_callers_tenant_only(tmp_path, model_dir):
    async def scenario(client, services):
        await client.post("/v1/completions", json=completion(), headers=ALICE)
        await client.post("/v1/completions", json={**completion(max_tokens=4), "n": 2}, headers=ALICE)
        stats = await settled(services)
        alice = await client.get("/v1/usage", headers=ALICE)
        bob = await client.get("/v1/usage", headers=BOB)
        asks_for_alice = await client.get("/v1/usage", params={"tenant": "alice"}, headers=BOB)
        user_key = await client.get("/v1/usage", headers=ALICE_USER)
        anonymous = await client.get("/v1/usage")
        return alice, bob, asks_for_alice, user_key, anonymous, stats

    alice, bob, asks_for_alice, user_key, anonymous, stats = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert alice.status_code == 200, alice.text
    body = alice.json()
    # Three engine requests (n = 2 is two): 3 x 5 prompt tokens, 8 + 2 x 4 generated.
    assert {k: body[k] for k in ("object", "tenant", "requests", "prompt_tokens", "completion_tokens")} == {
        "object": "usage",
        "tenant": "alice",
        "requests": 3,
        "prompt_tokens": 15,
        "completion_tokens": 16,
    }
    assert body["total_tokens"] == 31 and body["weight"] == 2.0 and body["share"] == 1.0
    # The token window counts each prompt once: 5 + 8, then 5 + 2 x 4.
    assert body["max_tokens_per_minute"] == 30 and body["tokens_last_minute"] == 13 + 13
    assert body["queue_time_seconds"] >= 0 and body["running"] == body["waiting"] == 0
    assert bob.status_code == 200
    assert {k: bob.json()[k] for k in ("tenant", "requests", "prompt_tokens", "share")} == {
        "tenant": "bob",
        "requests": 0,
        "prompt_tokens": 0,
        "share": 0.0,
    }
    assert "alice" not in bob.text
    assert asks_for_alice.status_code == 400 and "alice" not in asks_for_alice.text
    assert user_key.status_code == 403 and anonymous.status_code == 401
    # The tenant and the key's weight reached the engine's scheduler with each request.
    (engine_alice,) = [t for t in stats.tenants if t.tenant == "alice"]
    assert engine_alice.weight == 2.0 and engine_alice.num_generation_tokens == 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_window_slides_settles_to_the_use_and_computes_retry_after():
    clock = Clock()
    limiter = TokenRateLimiter(clock)
    alice = Principal(tenant="alice", role="user", max_tokens_per_minute=100)
    first = limiter.try_reserve(alice, 60)  # t = 1000
    clock.now += 20
    limiter.try_reserve(alice, 40)  # t = 1020: the window is full
    with pytest.raises(TooManyRequests) as refused:
        limiter.try_reserve(alice, 30)
    assert refused.value.retry_after_s == 40  # the first charge leaves the window at t = 1060
    first.settle(10)  # it used 10 of the 60 it might have: 50 tokens come back at once
    first.settle(60)  # settled once; later calls change nothing
    assert limiter.used("alice") == 50
    limiter.try_reserve(alice, 30)
    clock.now += 40  # t = 1060: the first charge has aged out
    assert limiter.used("alice") == 70
    with pytest.raises(TooManyRequests, match="more than the tenant's limit"):
        limiter.try_reserve(alice, 101)
    clock.now += 61  # everything has aged out
    # No max_tokens: the prompt alone is charged at admission, what it generated when it ends.
    open_ended = limiter.try_reserve(alice, 5)
    open_ended.settle(5 + 95)
    assert limiter.used("alice") == 100
    with pytest.raises(TooManyRequests):
        limiter.try_reserve(alice, 1)
    unlimited = Principal(tenant="bob", role="user")
    for _ in range(10):
        limiter.try_reserve(unlimited, 10_000)
    assert limiter.used("bob") == 0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"weight": 0}, "weight must be a number"),
        ({"weight": -1.5}, "weight must be a number"),
        ({"weight": "2"}, "weight must be a number"),
        ({"weight": True}, "weight must be a number"),
        ({"max_tokens_per_minute": 0}, "max_tokens_per_minute must be a positive integer"),
        ({"max_tokens_per_minute": 1.5}, "max_tokens_per_minute must be a positive integer"),
    ],
)
def test_keys_file_refuses_bad_weights_and_token_limits(entry, message):
    with pytest.raises(InvalidKeysFile, match=message):
        parse_api_keys({"sk-x": {"tenant": "acme", **entry}})


def test_keys_file_reads_weight_and_token_limit():
    (key,) = parse_api_keys({"sk-x": {"tenant": "acme", "weight": 3, "max_tokens_per_minute": 5000}})
    principal = Principal.from_key(key)
    assert (principal.weight, principal.max_tokens_per_minute) == (3.0, 5000)
    (default,) = parse_api_keys({"sk-y": {"tenant": "acme"}})
    assert (default.weight, default.max_tokens_per_minute) == (1.0, None)
