"""The OpenAI/vLLM surface real clients rely on, through the official `openai` client against the app:
max_tokens beyond the context is vLLM's 400, echo with max_tokens 0 scores the prompt, models.retrieve,
a chat stream opens with the role alone, token ids are null unless asked for, vLLM's usage flags and
GET /load."""

from __future__ import annotations

import asyncio

import openai
import pytest
from app_fixtures import MAX_MODEL_LEN, make_text_model
from factories import make_adapter
from loraserve.ops.server_load import ServerLoad
from test_inference_completions import run, sse_events


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("surface") / "model")


def sdk(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0
    )


MESSAGES = [{"role": "user", "content": "What is the answer?"}]


@pytest.mark.slow
def test_max_tokens_beyond_the_context_is_vllms_400(tmp_path, model_dir):
    async def scenario(client, services):
        api = sdk(client)
        prompt_ids = services.tokenizer("Hello world").input_ids
        errors = {}
        for name, call in {
            "completion": api.completions.create(model="tiny", prompt="Hello world", max_tokens=100000),
            "chat": api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100000),
            "chat_new_name": api.chat.completions.create(
                model="tiny", messages=MESSAGES, max_completion_tokens=MAX_MODEL_LEN
            ),
        }.items():
            with pytest.raises(openai.BadRequestError) as caught:
                await call
            errors[name] = caught.value.body
        fits = await api.completions.create(
            model="tiny", prompt="Hello world", max_tokens=MAX_MODEL_LEN - len(prompt_ids), temperature=0
        )
        return errors, len(prompt_ids), fits

    errors, prompt_len, fits = run(tmp_path, model_dir, scenario)
    assert errors["completion"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 100000. This model's maximum context "
        f"length is {MAX_MODEL_LEN} tokens and your request has {prompt_len} input tokens "
        f"(100000 > {MAX_MODEL_LEN} - {prompt_len})."
    )
    assert errors["completion"]["code"] == "context_length_exceeded"
    assert errors["completion"]["param"] == "max_tokens"
    assert "is too large: 100000" in errors["chat"]["message"]
    assert f"is too large: {MAX_MODEL_LEN}." in errors["chat_new_name"]["message"]
    assert fits.choices[0].finish_reason in ("stop", "length")  # exactly the room left is allowed


@pytest.mark.slow
def test_echo_with_max_tokens_zero_scores_the_prompt(tmp_path, model_dir):
    async def scenario(client, services):
        api = sdk(client)
        scored = await api.completions.create(
            model="tiny", prompt="Hello world", max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        stream = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "Hello world", "max_tokens": 0, "echo": True, "stream": True},
        )
        with pytest.raises(openai.BadRequestError) as caught:
            await api.completions.create(model="tiny", prompt="Hello world", max_tokens=0)
        return scored, stream, caught.value.body, services.tokenizer("Hello world").input_ids

    scored, stream, no_echo, prompt_ids = run(tmp_path, model_dir, scenario)
    choice = scored.choices[0]
    assert choice.text == "Hello world"
    assert len(choice.logprobs.tokens) == len(prompt_ids)  # the prompt's tokens only, nothing generated
    assert choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(lp, float) for lp in choice.logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt_ids)
    events = [e for e in sse_events(stream.text) if e != "[DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == "Hello world"
    assert "max_tokens must be at least 1" in no_echo["message"] and no_echo["param"] == "max_tokens"


@pytest.mark.slow
def test_models_retrieve(tmp_path, model_dir):
    adapter = make_adapter(
        model_dir, tmp_path / "adapter", seed=4, r=4, lora_alpha=8, target_modules=["q_proj"]
    )

    async def scenario(client, services):
        services.adapter_store.put("default", "support", adapter)
        api = sdk(client)
        found = [await api.models.retrieve(m) for m in ("tiny", "support", "support@1", "default/support")]
        with pytest.raises(openai.NotFoundError) as caught:
            await api.models.retrieve("this-model-does-not-exist")
        return found, caught.value.body

    (base, latest, version, qualified), missing = run(tmp_path, model_dir, scenario)
    assert (base.id, base.root, base.model_extra["parent"]) == ("tiny", "tiny", None)
    assert base.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert (latest.id, latest.root, latest.model_extra["parent"]) == ("support", "support@1", "tiny")
    assert version.id == "support@1" and qualified.id == "support"
    assert "does not exist" in missing["message"] and missing["code"] == "model_not_found"


@pytest.mark.slow
def test_chat_stream_opens_with_the_role_alone_and_token_ids_are_null_unless_asked(tmp_path, model_dir):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    eos = {"ignore_eos": True}

    async def scenario(client, services):
        api = sdk(client)
        chunks = [c async for c in await api.chat.completions.create(**body, stream=True, extra_body=eos)]
        with_ids = [
            c
            async for c in await api.chat.completions.create(
                **body, stream=True, extra_body={**eos, "return_token_ids": True}
            )
        ]
        whole = (await client.post("/v1/chat/completions", json={**body, **eos})).json()
        completion = (
            await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
        ).json()
        return chunks, with_ids, whole, completion

    chunks, with_ids, whole, completion = run(tmp_path, model_dir, scenario)
    first, *rest = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert first.choices[0].finish_reason is None
    assert all(c.choices[0].delta.role is None for c in rest)
    assert (
        "".join(c.choices[0].delta.content or "" for c in rest) == whole["choices"][0]["message"]["content"]
    )
    assert rest[-1].choices[0].finish_reason == "length"
    # return_token_ids: the prompt's ids in the opening chunk alone; each later chunk its new tokens
    assert isinstance(with_ids[0].prompt_token_ids, list) and with_ids[0].prompt_token_ids
    assert all("prompt_token_ids" not in c.model_dump(exclude_unset=True) for c in with_ids[1:])
    assert sum(len(c.choices[0].token_ids) for c in with_ids[1:]) == 4
    # not asked for: null in whole answers (vLLM's), never left out
    assert whole["prompt_token_ids"] is None and whole["choices"][0]["token_ids"] is None
    assert completion["choices"][0]["prompt_token_ids"] is None
    assert completion["choices"][0]["token_ids"] is None


@pytest.mark.slow
def test_usage_flags_as_vllms(tmp_path, model_dir):
    """--enable-prompt-tokens-details adds cached_tokens (off: null); --enable-force-include-usage puts the
    usage in every chunk of every stream, growing, and ends it with a usage chunk."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    body["extra_body"] = {"ignore_eos": True}

    async def scenario(client, services):
        api = sdk(client)
        plain = await api.chat.completions.create(**body)
        services.prompt_tokens_details = True
        services.force_include_usage = True
        detailed = await api.chat.completions.create(**body)
        chunks = [c async for c in await api.chat.completions.create(**body, stream=True)]
        return plain, detailed, chunks

    plain, detailed, chunks = run(tmp_path, model_dir, scenario)
    assert plain.usage.prompt_tokens_details is None
    assert detailed.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    last = 0
    for chunk in chunks:
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert (
            last == 0
            or usage.completion_tokens > last
            or (not chunk.choices and usage.completion_tokens == last)
        )
        last = usage.completion_tokens
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5


@pytest.mark.slow
def test_server_load(tmp_path, model_dir):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True}

    async def scenario(client, services):
        off = await client.get("/load")
        services.server_load = ServerLoad()
        idle = (await client.get("/load")).json()
        running = asyncio.create_task(client.post("/v1/completions", json=body))
        for _ in range(500):
            if services.server_load.in_flight:
                break
            await asyncio.sleep(0.01)
        busy = (await client.get("/load")).json()
        await running
        return off, idle, busy, (await client.get("/load")).json()

    off, idle, busy, after = run(tmp_path, model_dir, scenario)
    assert off.status_code == 404 and "--enable-server-load-tracking" in off.json()["error"]["message"]
    assert (idle, busy, after) == ({"server_load": 0}, {"server_load": 1}, {"server_load": 0})
