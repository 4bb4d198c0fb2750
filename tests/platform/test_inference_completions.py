"""POST /v1/completions through the real app and engine: greedy output equals transformers, and
n, multiple prompts, logprobs, stop, seed, streaming and usage behave as OpenAI's API says."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from app_fixtures import make_text_model, open_test_services
from factories import load_peft_reference, reference_greedy
from loraserve.app import create_app
from loraserve.settings import ServerSettings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("completions") / "model")


def run(tmp_path, model_dir, scenario, settings=None, **options):
    """Run `scenario(client, services)` against the app on this event loop.

    httpx's ASGI transport rather than Litestar's AsyncTestClient: the latter runs the app on a portal
    thread and blocks the test's loop per request, so concurrent requests could not be tested.
    """

    async def main():
        async with open_test_services(tmp_path, model_dir, **options) as services:
            app = create_app(settings or ServerSettings(), services=services)
            async with (
                app.lifespan(),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://testserver"
                ) as client,
            ):
                return await scenario(client, services)

    return asyncio.run(main())


def sse_events(text: str) -> list:
    """The decoded `data:` payloads of an SSE body; `[DONE]` stays a string."""
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_greedy_completion_equals_transformers(tmp_path, model_dir):
    prompt_ids = [5, 17, 42, 99, 7]
    reference = reference_greedy(load_peft_reference(model_dir, {}), prompt_ids, None, 8)

    async def scenario(client, services):
        body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        return response, services.tokenizer

    response, tokenizer = run(tmp_path, model_dir, scenario)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert response.headers["x-loraserve-variant"] == "tiny"
    assert body["choices"][0]["text"] == tokenizer.decode(reference)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 8,
        "total_tokens": 13,
        "prompt_tokens_details": None,  # vLLM's: only with --enable-prompt-tokens-details
    }


@pytest.mark.slow
def test_prompts_times_n_give_indexed_choices_and_summed_usage(tmp_path, model_dir):
    async def scenario(client, services):
        body = {
            "model": "tiny",
            "prompt": ["Hello world", "The answer is"],
            "n": 2,
            "max_tokens": 4,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
        }
        return await client.post("/v1/completions", json=body), services.tokenizer

    response, tokenizer = run(tmp_path, model_dir, scenario)
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    prompt_tokens = len(tokenizer("Hello world").input_ids) + len(tokenizer("The answer is").input_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 16,
        "total_tokens": prompt_tokens + 16,
        "prompt_tokens_details": None,
    }


@pytest.mark.slow
def test_seed_reproduces_sampling_and_logprobs_are_consistent(tmp_path, model_dir):
    async def scenario(client, services):
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 6,
            "temperature": 1.0,
            "seed": 11,
            "logprobs": 3,
            "ignore_eos": True,
        }
        first = (await client.post("/v1/completions", json=body)).json()
        second = (await client.post("/v1/completions", json=body)).json()
        other = (await client.post("/v1/completions", json={**body, "seed": 12})).json()
        return first, second, other

    first, second, other = run(tmp_path, model_dir, scenario)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["text"] != other["choices"][0]["text"]
    logprobs = first["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 6
    assert "".join(logprobs["tokens"]) == first["choices"][0]["text"]
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert logprob <= 0 and top[token] == pytest.approx(logprob)
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
    assert logprobs["text_offset"][0] == 0


@pytest.mark.slow
def test_stop_string_ends_the_text_before_it(tmp_path, model_dir):
    async def scenario(client, services):
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        full = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = full[len(full) // 2 :][:2]
        cut = (await client.post("/v1/completions", json={**body, "stop": [stop]})).json()["choices"][0]
        return full, stop, cut

    full, stop, cut = run(tmp_path, model_dir, scenario)
    assert stop and stop not in cut["text"]
    assert cut["finish_reason"] == "stop"
    assert full.startswith(cut["text"]) and full.index(stop) == len(cut["text"])


@pytest.mark.slow
def test_stream_concatenates_to_the_whole_response_and_ends_with_done(tmp_path, model_dir):
    async def scenario(client, services):
        body = {
            "model": "tiny",
            "prompt": "Hello world",
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
            "n": 2,
        }
        whole = (await client.post("/v1/completions", json=body)).json()
        stream = await client.post(
            "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        return whole, stream

    whole, stream = run(tmp_path, model_dir, scenario, prompt_tokens_details=True)
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage_chunk["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    # the same prompt again: its full blocks now come from the prefix cache
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for index in (0, 1):
        parts = [c["text"] for e in events[:-2] for c in e["choices"] if c["index"] == index]
        assert "".join(parts) == whole["choices"][index]["text"]
        reasons = [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["index"] == index]
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


@pytest.mark.slow
def test_unset_sampling_fields_take_the_models_defaults(tmp_path, model_dir):
    """As vLLM with --generation-config auto: the model's generation_config.json fills what a request omits
    (here greedy, so the output must be transformers' greedy tokens); a field the request sets wins."""
    prompt_ids = [5, 17, 42, 99, 7]
    reference = reference_greedy(load_peft_reference(model_dir, {}), prompt_ids, None, 8)

    async def scenario(client, services):
        services.sampling_defaults = {"temperature": 0.0}  # what bootstrap reads from the model folder
        body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 8, "ignore_eos": True, "n": 4}
        unset = await client.post("/v1/completions", json=body)
        sampled = await client.post("/v1/completions", json={**body, "temperature": 1.0, "seed": 1})
        return unset, sampled, services.tokenizer

    unset, sampled, tokenizer = run(tmp_path, model_dir, scenario)
    assert unset.status_code == 200, unset.text
    assert [c["text"] for c in unset.json()["choices"]] == [tokenizer.decode(reference)] * 4
    assert len({c["text"] for c in sampled.json()["choices"]}) > 1


@pytest.mark.slow
def test_stream_sends_one_choice_per_chunk_cached_tokens_and_continuous_usage(tmp_path, model_dir):
    """With n > 1 each chunk carries one choice (as OpenAI and vLLM send them), no chunk but the usage chunk
    has an empty `choices`, usage reports the prefix-cache hits of a repeated prompt, and
    continuous_usage_stats puts the usage so far in every chunk."""
    prompt = list(range(3, 40))  # several KV blocks, so a second run hits the prefix cache
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 5,
        "n": 3,
        "temperature": 1.0,
        "seed": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }

    async def scenario(client, services):
        first = await client.post("/v1/completions", json={**body, "stream": False, "stream_options": None})
        return first, await client.post("/v1/completions", json=body)

    first, streamed = run(tmp_path, model_dir, scenario, prompt_tokens_details=True)
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    events = [e for e in sse_events(streamed.text) if e != "[DONE]"]
    *chunks, usage_chunk = events
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 15
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # whole blocks of the prompt
    completed = [c["usage"]["completion_tokens"] for c in chunks]
    assert completed == sorted(completed) and completed[-1] == 15
