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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_token_window_charges_use_when_it_happens_and_holds_what_may_come():
    clock = Clock()
    limiter = TokenRateLimiter(clock)
    alice = Principal(tenant="alice", role="user", max_tokens_per_minute=100)
    first = limiter.try_reserve(alice, 20, 40)  # t = 1000: 20 prompt tokens charged, 40 held
    assert (limiter.used("alice"), limiter.held("alice")) == (20, 40)
    clock.now += 20
    second = limiter.try_reserve(alice, 30)  # t = 1020: 50 used, 40 held: 90 of 100
    with pytest.raises(TooManyRequests) as refused:
        limiter.try_reserve(alice, 11)
    assert refused.value.retry_after_s == 40  # the first prompt leaves the window at t = 1060
    first.charge(10)  # it generated 10 of its 40
    assert (limiter.used("alice"), limiter.held("alice"), first.held) == (60, 30, 30)
    first.release()  # it ended: the other 30 it might have used come back at once
    first.release()  # idempotent
    assert (limiter.used("alice"), limiter.held("alice")) == (60, 0)
    limiter.try_reserve(alice, 40).release()  # 60 + 40 fits exactly
    clock.now += 40  # t = 1060: the first prompt (20) has aged out, the 10 generated at t = 1020 not
    assert limiter.used("alice") == 80
    # A request without max_tokens holds nothing; what it generates is charged when generated, in the
    # window of that moment: a request running for minutes is counted minute by minute.
    clock.now += 61  # everything has aged out
    second.charge(95)
    assert limiter.used("alice") == 95
    clock.now += 30
    second.charge(50)  # still running 2.5 minutes after admission
    assert limiter.used("alice") == 145  # over the limit: running requests are never cut, new ones wait
    with pytest.raises(TooManyRequests) as over:
        limiter.try_reserve(alice, 1)
    assert over.value.retry_after_s == 30  # the 95 leave the window at +60 s from their charge
    clock.now += 30
    assert limiter.used("alice") == 50
    with pytest.raises(TooManyRequests, match="more than the tenant's limit"):
        limiter.try_reserve(alice, 1, 100)
    # Holds of running requests that stand in the way: Retry-After is the whole window.
    clock.now += 61
    held = limiter.try_reserve(alice, 0, 90)
    with pytest.raises(TooManyRequests) as by_holds:
        limiter.try_reserve(alice, 20)
    assert by_holds.value.retry_after_s == 60 and "may use 90 more" in str(by_holds.value)
    held.release()
    # A key without a limit is never refused, but its use counts in the tenant's window (which its
    # tenant's limited keys compare against).
    unlimited = Principal(tenant="bob", role="user")
    for _ in range(10):
        limiter.try_reserve(unlimited, 10_000).charge(5)
    assert limiter.used("bob") == 100_050


def test_charges_within_a_second_share_one_entry_and_never_leave_early():
    clock = Clock()
    limiter = TokenRateLimiter(clock)
    alice = Principal(tenant="alice", role="user", max_tokens_per_minute=10**9)
    reservation = limiter.try_reserve(alice, 1)
    for _ in range(1000):  # 1,000 deltas over 100 s
        clock.now += 0.1
        reservation.charge(1)
    # 600 tokens were generated in the last 60 s; a bucket keeps at most a second's more (10), never fewer
    assert 600 <= limiter.used("alice") <= 611
    row = limiter.table.row("alice", now=clock.now, create=False)
    assert (limiter.table._rows["at"][row] > clock.now - 60).sum() <= 61  # one bucket per second
    clock.now += 60.0  # the last charge's bucket is at most a second old then: gone
    assert limiter.used("alice") == 0


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
