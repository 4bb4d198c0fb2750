"""POST /tokenize, POST /detokenize and GET /tokenizer_info as vLLM answers them, per tenant."""

from __future__ import annotations

import asyncio

import pytest
from app_fixtures import keys_for, make_text_model
from factories import make_adapter
from test_inference_completions import run

ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}
KEYS = keys_for(alice=("sk-alice", "admin", None), bob=("sk-bob", "user", None))
MESSAGES = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("tokenize") / "model")


@pytest.mark.slow
def test_tokenize_detokenize_and_info(tmp_path, model_dir):
    async def scenario(client, services):
        tokenizer = services.tokenizer
        prompt = await client.post(
            "/tokenize",
            json={"model": "tiny", "prompt": "Hello world!", "return_token_strs": True},
            headers=ALICE,
        )
        chat = await client.post("/tokenize", json={"messages": MESSAGES}, headers=BOB)
        back = await client.post("/detokenize", json={"tokens": prompt.json()["tokens"]}, headers=BOB)
        info = await client.get("/tokenizer_info", headers=BOB)
        expected_chat = tokenizer(
            tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        return prompt, chat, back, info, tokenizer("Hello world!").input_ids, expected_chat, tokenizer

    prompt, chat, back, info, expected_prompt, expected_chat, tokenizer = run(
        tmp_path, model_dir, scenario, api_keys=KEYS
    )
    assert prompt.status_code == 200, prompt.text
    body = prompt.json()
    assert body["tokens"] == expected_prompt and body["count"] == len(expected_prompt)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected_prompt)
    assert body["max_model_len"] == 128
    assert chat.json()["tokens"] == expected_chat and chat.json()["token_strs"] is None
    assert back.json() == {"prompt": "Hello world!"}
    assert info.status_code == 200
    assert info.json()["eos_token"] == "<|endoftext|>" and info.json()["vocab_size"] == len(tokenizer)
    assert "im_start" in info.json()["chat_template"]


@pytest.mark.slow
def test_tokenizer_endpoints_refuse_bad_input_and_other_tenants_names(tmp_path, model_dir):
    async def scenario(client, services):
        adapter = make_adapter(model_dir, tmp_path / "mine", r=4, lora_alpha=8, target_modules=["q_proj"])
        await asyncio.to_thread(services.adapter_store.put, "alice", "mine", adapter)
        return [
            await client.post("/tokenize", json={"model": "mine", "prompt": "x"}, headers=ALICE),
            await client.post("/tokenize", json={"model": "mine", "prompt": "x"}, headers=BOB),
            await client.post("/detokenize", json={"model": "mine", "tokens": [1]}, headers=BOB),
            await client.post("/tokenize", json={"prompt": "x"}),
            await client.post("/tokenize", json={"prompt": "x", "messages": MESSAGES}, headers=BOB),
            await client.post("/tokenize", json={}, headers=BOB),
            await client.post("/detokenize", json={"tokens": [1, 10**6]}, headers=BOB),
            await client.post("/detokenize", json={"tokens": [-1]}, headers=BOB),
            await client.post(
                "/tokenize",
                json={"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
                headers=BOB,
            ),
        ]

    answers = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    statuses = [a.status_code for a in answers]
    assert statuses == [200, 404, 404, 401, 400, 400, 400, 400, 400], [a.text for a in answers]
    assert "mine" in answers[1].json()["error"]["message"]  # the name the caller sent, nothing more
    assert "vocabulary" in answers[6].json()["error"]["message"]
    assert "assistant" in answers[8].json()["error"]["message"]


@pytest.mark.slow
def test_invocations_routes_by_the_body_shape(tmp_path, model_dir):
    """SageMaker's /invocations: `messages` -> chat completion, `prompt` -> completion, neither or both -> 400."""
    base = {"model": "tiny", "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def scenario(client, services):
        chat = await client.post("/invocations", json={**base, "messages": MESSAGES}, headers=BOB)
        direct_chat = await client.post(
            "/v1/chat/completions", json={**base, "messages": MESSAGES}, headers=BOB
        )
        completion = await client.post("/invocations", json={**base, "prompt": "Hello"}, headers=BOB)
        neither = await client.post("/invocations", json=base, headers=BOB)
        bad = await client.post("/invocations", json={**base, "prompt": "x", "max_tokens": -1}, headers=BOB)
        anonymous = await client.post("/invocations", json={**base, "prompt": "x"})
        return chat, direct_chat, completion, neither, bad, anonymous

    chat, direct_chat, completion, neither, bad, anonymous = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.json()["choices"][0]["message"] == direct_chat.json()["choices"][0]["message"]
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert (
        neither.status_code == 400
        and bad.status_code == 400
        and "max_tokens" in bad.json()["error"]["message"]
    )
    assert anonymous.status_code == 401
