"""vLLM's response-shaping fields through the official `openai` client against the real app: echo,
return_token_ids, truncate_prompt_tokens, custom chat roles, continue_final_message; values that cannot
be honoured are 400s rather than ignored (prompt_logprobs: test_prompt_logprobs_api.py)."""

from __future__ import annotations

import openai
import pytest
from app_fixtures import make_text_model
from test_inference_completions import run, sse_events


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("shape") / "model")


def sdk(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0
    )


GREEDY = {"max_tokens": 5, "temperature": 0}


@pytest.mark.slow
def test_echo_token_ids_and_truncation(tmp_path, model_dir):
    async def scenario(client, services):
        api = sdk(client)
        plain = await api.completions.create(model="tiny", prompt="Hello world", **GREEDY)
        echoed = await api.completions.create(
            model="tiny", prompt="Hello world", **GREEDY, echo=True, extra_body={"return_token_ids": True}
        )
        streamed = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "Hello world", **GREEDY, "echo": True, "stream": True},
        )
        long_prompt = list(range(3, 60))
        cut = await api.completions.create(
            model="tiny",
            prompt=long_prompt,
            **GREEDY,
            extra_body={"truncate_prompt_tokens": 8, "return_token_ids": True},
        )
        tail = await api.completions.create(model="tiny", prompt=long_prompt[-8:], **GREEDY)
        return plain, echoed, streamed, cut, tail, services.tokenizer

    plain, echoed, streamed, cut, tail, tokenizer = run(tmp_path, model_dir, scenario)
    choice = echoed.choices[0]
    assert choice.text == "Hello world" + plain.choices[0].text
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == tokenizer("Hello world").input_ids
    assert tokenizer.decode(extra["token_ids"]) == plain.choices[0].text and len(extra["token_ids"]) == 5
    texts = [e["choices"][0]["text"] for e in sse_events(streamed.text) if e != "[DONE]" and e["choices"]]
    assert "".join(texts) == choice.text and texts[0].startswith("Hello world")
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].model_extra["prompt_token_ids"] == list(
        range(52, 60)
    )
    assert cut.choices[0].text == tail.choices[0].text
    # not asked for: null, as vLLM answers
    assert plain.choices[0].model_extra["token_ids"] is None
    assert plain.choices[0].model_extra["prompt_token_ids"] is None


@pytest.mark.slow
def test_chat_roles_continuation_and_token_ids(tmp_path, model_dir):
    messages = [
        {"role": "narrator", "content": "A story."},  # a custom role: the template decides
        {"role": "user", "content": "Go on"},
        {"role": "assistant", "content": "Once upon"},
    ]

    async def scenario(client, services):
        api = sdk(client)
        continued = await api.chat.completions.create(
            model="tiny",
            messages=messages,
            **GREEDY,
            extra_body={
                "continue_final_message": True,
                "add_generation_prompt": False,
                "echo": True,
                "return_token_ids": True,
            },
        )
        rendered = services.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
        )
        return continued, services.tokenizer(rendered, add_special_tokens=False).input_ids

    continued, expected_prompt = run(tmp_path, model_dir, scenario)
    assert continued.choices[0].message.content.startswith("Once upon")
    assert continued.model_extra["prompt_token_ids"] == expected_prompt
    assert len(continued.choices[0].model_extra["token_ids"]) == continued.usage.completion_tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("completions", {"extra_body": {"truncate_prompt_tokens": -2}}, "truncate_prompt_tokens"),
        (
            "chat",
            {"extra_body": {"continue_final_message": True, "add_generation_prompt": True}},
            "continue_final_message",
        ),
    ],
)
def test_fields_that_cannot_be_honoured_are_400s(tmp_path, model_dir, path, fields, param):
    async def scenario(client, services):
        api = sdk(client)
        with pytest.raises(openai.BadRequestError) as error:
            if path == "completions":
                await api.completions.create(model="tiny", prompt="x", max_tokens=2, **fields)
            else:
                messages = [{"role": "user", "content": "x"}]
                await api.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **fields)
        return error.value

    error = run(tmp_path, model_dir, scenario)
    assert error.status_code == 400 and param in error.message


@pytest.mark.slow
def test_stream_options_as_vllm_reads_them(tmp_path, model_dir):
    """As vLLM's test_completion_stream_options: the usage chunk only with include_usage true, usage in
    every chunk only with continuous_usage_stats as well; `{}` asks for nothing (and passes without a
    stream), a set field without a stream is a 400."""

    async def scenario(client, services):
        api = sdk(client)
        base = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        results = {}
        for name, options in (
            ("empty", {}),
            ("null", {"include_usage": None}),
            ("off", {"include_usage": False}),
            ("continuous_alone", {"continuous_usage_stats": True}),
            ("continuous", {"include_usage": True, "continuous_usage_stats": True}),
        ):
            stream = await api.completions.create(**base, stream=True, stream_options=options)
            results[name] = [chunk async for chunk in stream]
        plain = await api.completions.create(**base, stream=False, extra_body={"stream_options": {}})
        with pytest.raises(openai.BadRequestError) as refused:
            await api.completions.create(**base, stream=False, stream_options={"include_usage": None})
        return results, plain, refused.value

    results, plain, refused = run(tmp_path, model_dir, scenario)
    for name in ("empty", "null", "off", "continuous_alone"):
        assert all(chunk.choices and chunk.usage is None for chunk in results[name])
    assert all(chunk.usage is not None for chunk in results["continuous"])
    assert results["continuous"][-1].choices == [] and results["continuous"][-1].usage.completion_tokens == 3
    assert plain.usage.completion_tokens == 3
    assert refused.status_code == 400 and "stream_options" in refused.message
