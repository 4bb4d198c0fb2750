"""Auth (401/403), tenant isolation (another tenant's adapter is a 404 like a missing one), adapter output
equal to transformers + PEFT, and the per-tenant concurrency limit (429 with Retry-After)."""

from __future__ import annotations

import asyncio

import pytest
from app_fixtures import keys_for, make_text_model
from factories import load_peft_reference, make_adapter, reference_greedy
from test_inference_completions import run

ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}
KEYS = keys_for(alice=("sk-alice", "admin", 1), bob=("sk-bob", "user", None))
PROMPT = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("tenancy") / "model")


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return make_adapter(
        model_dir,
        tmp_path_factory.mktemp("tenancy-adapter") / "helper",
        seed=4,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )


def completion(model, **extra):
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        **extra,
    }


@pytest.mark.slow
def test_missing_malformed_and_unknown_keys_are_401(tmp_path, model_dir):
    async def scenario(client, services):
        return [
            await client.post("/v1/completions", json=completion("tiny"), headers=headers)
            for headers in ({}, {"authorization": "Basic abc"}, {"authorization": "Bearer sk-nobody"})
        ]

    for response in run(tmp_path, model_dir, scenario, api_keys=KEYS):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in response.json()["error"]["message"]


def test_adapter_serves_its_tenant_only_and_matches_peft(tmp_path, model_dir, adapter_dir):
    reference = reference_greedy(load_peft_reference(model_dir, {"helper": adapter_dir}), PROMPT, "helper", 8)

    async def scenario(client, services):
        services.adapter_store.put("alice", "helper", adapter_dir)
        own = await client.post("/v1/completions", json=completion("helper"), headers=ALICE)
        pinned = await client.post("/v1/completions", json=completion("helper@1"), headers=ALICE)
        foreign = [
            await client.post("/v1/completions", json=completion(m), headers=BOB)
            for m in ("helper", "helper@1")
        ]
        missing = [
            await client.post("/v1/completions", json=completion(m), headers=BOB)
            for m in ("ghost", "ghost@1")
        ]
        models = await client.get("/v1/models", headers=BOB)
        upload = await client.post("/v1/adapters", data={"name": "x"}, headers=BOB)
        return own, pinned, foreign, missing, models, upload, services.tokenizer

    own, pinned, foreign, missing, models, upload, tokenizer = run(
        tmp_path, model_dir, scenario, api_keys=KEYS
    )
    assert own.status_code == 200, own.text
    assert own.json()["model"] == "helper@1" and own.headers["x-loraserve-variant"] == "helper@1"
    tokens = own.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in reference]
    assert pinned.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
    for theirs, nothing in zip(foreign, missing):
        assert theirs.status_code == nothing.status_code == 404
        # Indistinguishable from a name that exists nowhere, apart from the name itself.
        assert (
            theirs.json()["error"]["message"].replace("helper", "ghost") == nothing.json()["error"]["message"]
        )
        assert theirs.json()["error"]["code"] == nothing.json()["error"]["code"] == "model_not_found"
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert upload.status_code == 403 and upload.json()["error"]["type"] == "permission_error"


@pytest.mark.slow
def test_tenant_over_its_limit_gets_429_while_others_are_served(tmp_path, model_dir):
    async def scenario(client, services):
        long = completion("tiny", max_tokens=110, stream=True)
        first = asyncio.create_task(client.post("/v1/completions", json=long, headers=ALICE))
        for _ in range(2000):
            if services.limiter.in_flight("alice"):
                break
            await asyncio.sleep(0.001)
        refused = await client.post("/v1/completions", json=completion("tiny"), headers=ALICE)
        other = await client.post("/v1/completions", json=completion("tiny"), headers=BOB)
        await first
        again = await client.post("/v1/completions", json=completion("tiny"), headers=ALICE)
        return first.result(), refused, other, again

    first, refused, other, again = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert first.status_code == 200 and first.text.endswith("data: [DONE]\n\n")
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert other.status_code == 200
    assert again.status_code == 200  # the stream's lease was released when it ended
