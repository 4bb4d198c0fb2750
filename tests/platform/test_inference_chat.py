"""POST /v1/chat/completions: the tokenizer's chat template, greedy equality with transformers, streaming
with a role-only chunk first, logprobs with top_logprobs, and a clear 400 for a model without a template."""

from __future__ import annotations

import pytest
from app_fixtures import make_text_model, make_tokenizer
from factories import load_peft_reference, reference_greedy
from test_inference_completions import run, sse_events

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("chat") / "model")


def test_chat_renders_the_template_and_matches_transformers(tmp_path, model_dir):
    tokenizer = make_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    reference = reference_greedy(load_peft_reference(model_dir, {}), prompt_ids, None, 6)

    async def scenario(client, services):
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        return await client.post("/v1/chat/completions", json=body)

    response = run(tmp_path, model_dir, scenario)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(reference)}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 6,
        "total_tokens": len(prompt_ids) + 6,
        "prompt_tokens_details": None,  # vLLM's: only with --enable-prompt-tokens-details
    }


@pytest.mark.slow
def test_chat_stream_and_logprobs(tmp_path, model_dir):
    async def scenario(client, services):
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "max_completion_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
        }
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
        return whole, stream

    whole, stream = run(tmp_path, model_dir, scenario)
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    assert "".join(item["token"] for item in content) == whole["choices"][0]["message"]["content"]
    for item in content:
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
        assert item["bytes"] == list(item["token"].encode())
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    # the opening chunk carries the role alone (content "", no logprobs), as OpenAI and vLLM send it
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["logprobs"] is None
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    # The second request reuses cached prefix blocks, so logprobs agree to float32 rounding only.
    assert [t["logprob"] for t in streamed] == pytest.approx([t["logprob"] for t in content], abs=1e-4)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_model_without_chat_template_is_a_clear_400(tmp_path, model_dir):
    async def scenario(client, services):
        services.tokenizer = make_tokenizer(chat_template=None)
        body = {"model": "tiny", "messages": MESSAGES}
        chat = await client.post("/v1/chat/completions", json=body)
        completion = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}
        )
        return chat, completion

    chat, completion = run(tmp_path, model_dir, scenario)
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert error["code"] == "no_chat_template" and error["type"] == "invalid_request_error"
    assert "chat template" in error["message"] and "/v1/completions" in error["message"]
    assert completion.status_code == 200


@pytest.mark.slow
def test_non_text_content_parts_are_refused(tmp_path, model_dir):
    async def scenario(client, services):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        return await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})

    response = run(tmp_path, model_dir, scenario)
    assert response.status_code == 400 and "image_url" in response.json()["error"]["message"]
