"""Requests as vLLM's server tests send them, through the official `openai` client against the app:
--root-path served in both forms, vLLM's wordings for bad prompts, truncation_side, options this server
lacks refused rather than ignored, completions logprobs as vLLM lists them, and
POST /v1/chat/completions/batch."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from app_fixtures import make_text_model
from loraserve.root_path import AcceptRootPathPrefix
from test_inference_completions import run
from test_openai_surface import MESSAGES, sdk


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("requests") / "model")


@pytest.mark.slow
def test_root_path_serves_both_forms(tmp_path, model_dir):
    """As uvicorn runs it under --root-path /llm (the prefix written in front of every path): `/v1/...`
    from a proxy that stripped the prefix and `/llm/v1/...` sent straight to the server both route, and an
    unknown path's error names the path once."""

    async def scenario(client, services):
        app = client._transport.app

        async def like_uvicorn(scope, receive, send):
            if scope["type"] == "http":
                scope = {**scope, "root_path": "/llm", "path": "/llm" + scope["path"]}
            await AcceptRootPathPrefix(app, "/llm")(scope, receive, send)

        transport = httpx.ASGITransport(app=like_uvicorn)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as prefixed:
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
            return [
                await prefixed.post("/v1/chat/completions", json=body),
                await prefixed.post("/llm/v1/chat/completions", json=body),
                await prefixed.get("/llm/v1/nope"),
            ]

    stripped, sent, unknown = run(tmp_path, model_dir, scenario)
    assert stripped.status_code == 200 and sent.status_code == 200, (stripped.text, sent.text)
    message = unknown.json()["error"]["message"]
    assert unknown.status_code == 404 and message.count("/llm") == 1, message


@pytest.mark.slow
def test_prompt_wordings_as_vllms(tmp_path, model_dir):
    async def scenario(client, services):
        api = sdk(client)
        errors = {}
        for name, prompt in {"missing": None, "empty_list": [], "out_of_vocab": [999999]}.items():
            with pytest.raises(openai.BadRequestError) as caught:
                await api.completions.create(model="tiny", prompt=prompt, max_tokens=2)
            errors[name] = caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            await api.chat.completions.create(
                model="tiny", messages=MESSAGES, response_format={"type": "json_schema"}
            )
        errors["json_schema"] = caught.value.body["message"]
        kept = {}
        for side in ("left", "right", None):
            extra = {"truncate_prompt_tokens": 2, "return_token_ids": True}
            if side is not None:
                extra["truncation_side"] = side
            answer = await api.completions.create(
                model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=1, extra_body=extra
            )
            kept[side] = answer.choices[0].prompt_token_ids
        return errors, kept

    errors, kept = run(tmp_path, model_dir, scenario)
    assert kept == {"left": [8, 9], "right": [5, 6], None: [8, 9]}
    assert "Either prompt or prompt_embeds must be provided and non-empty" in errors["missing"]
    assert "prompt or prompt_embeds" in errors["empty_list"]
    assert "out of vocabulary" in errors["out_of_vocab"]
    assert re.search("json_schema.*must be provided", errors["json_schema"])


@pytest.mark.slow
def test_options_this_server_lacks_are_400s_and_logprobs_list_the_chosen_token_first(tmp_path, model_dir):
    async def scenario(client, services):
        api = sdk(client)
        refused = {}
        for param, extra in {
            "use_beam_search": {"extra_body": {"use_beam_search": True}},
            "logprob_token_ids": {"extra_body": {"logprob_token_ids": [1, 2]}},
            "suffix": {"suffix": "the end"},
            "best_of": {"best_of": 3},
        }.items():
            with pytest.raises(openai.BadRequestError) as caught:
                await api.completions.create(model="tiny", prompt="Hello", max_tokens=2, **extra)
            refused[param] = caught.value.body
        off = await api.completions.create(
            model="tiny", prompt="Hello", max_tokens=2, best_of=1, extra_body={"use_beam_search": False}
        )
        scored = await api.completions.create(
            model="tiny", prompt="Hello", max_tokens=4, logprobs=2, temperature=1.0, seed=3
        )
        services.tokens_as_token_ids = True  # --return-tokens-as-token-ids
        as_ids = await api.completions.create(model="tiny", prompt="Hello", max_tokens=2, logprobs=1)
        return refused, off, scored, as_ids

    refused, off, scored, as_ids = run(tmp_path, model_dir, scenario)
    assert {param: body["param"] for param, body in refused.items()} == {p: p for p in refused}
    assert off.choices[0].finish_reason in ("stop", "length")
    logprobs = scored.choices[0].logprobs
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
        assert next(iter(top)) == token  # the chosen token leads, as vLLM lists it
    assert all(token.startswith("token_id:") for token in as_ids.choices[0].logprobs.tokens)


@pytest.mark.slow
def test_batched_chat_completions(tmp_path, model_dir):
    """vLLM's POST /v1/chat/completions/batch: choice i answers conversation i, exactly as the same
    conversation alone would (greedy), with a JSON schema held for each; streaming is refused."""
    conversations = [MESSAGES, [{"role": "user", "content": "Hello world!"}]]
    greedy = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}

    async def scenario(client, services):
        batch = await client.post(
            "/v1/chat/completions/batch",
            json={**greedy, "messages": conversations, "logprobs": True, "top_logprobs": 1},
        )
        alone = [
            (await client.post("/v1/chat/completions", json={**greedy, "messages": c})).json()
            for c in conversations
        ]
        structured = await client.post(
            "/v1/chat/completions/batch",
            json={
                "model": "tiny",
                "messages": conversations,
                "response_format": json_schema,
                "max_tokens": 30,
            },
        )
        stream = await client.post(
            "/v1/chat/completions/batch", json={**greedy, "messages": conversations, "stream": True}
        )
        return batch, alone, structured, stream

    batch, alone, structured, stream = run(tmp_path, model_dir, scenario)
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["message"]["content"] for c in choices] == [
        a["choices"][0]["message"]["content"] for a in alone
    ]
    assert all(not t["token"].startswith("token_id:") for c in choices for t in c["logprobs"]["content"])
    assert batch.json()["usage"]["completion_tokens"] == 8
    assert structured.status_code == 200, structured.text
    for choice in structured.json()["choices"]:
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
