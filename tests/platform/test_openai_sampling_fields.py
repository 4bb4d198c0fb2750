"""OpenAI's and vLLM's sampling fields through the official `openai` client against the real app:
logit_bias, presence/frequency/repetition penalties, min_p and allowed_token_ids work, and values out of
range or outside the vocabulary are 400s."""

from __future__ import annotations

import openai
import pytest
from app_fixtures import make_text_model
from test_inference_completions import run

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("fields") / "model")


def sdk(client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0
    )


@pytest.mark.slow
def test_fields_change_the_output_as_defined(tmp_path, model_dir):
    async def scenario(client, services):
        api = sdk(client)
        base = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        plain = await api.completions.create(**base)
        biased = await api.completions.create(**base, logit_bias={"42": 100})
        allowed = await api.completions.create(
            **{**base, "extra_body": {"ignore_eos": True, "allowed_token_ids": [3, 4]}}
        )
        penalised = await api.completions.create(
            **{**base, "extra_body": {"ignore_eos": True, "repetition_penalty": 100.0}}
        )
        sampled = await api.completions.create(
            **{
                **base,
                "temperature": 1.0,
                "seed": 3,
                "presence_penalty": 1.5,
                "frequency_penalty": 0.5,
                "extra_body": {"ignore_eos": True, "min_p": 0.1},
            }
        )
        return plain, biased, allowed, penalised, sampled, services.tokenizer

    plain, biased, allowed, penalised, sampled, tokenizer = run(tmp_path, model_dir, scenario)
    assert biased.choices[0].text == tokenizer.decode([42] * 6)
    assert set(tokenizer(allowed.choices[0].text, add_special_tokens=False).input_ids) <= {3, 4}
    assert plain.usage.completion_tokens == penalised.usage.completion_tokens == 6
    assert sampled.usage.completion_tokens == 6


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ({"extra_body": {"allowed_token_ids": [10**7]}}, "allowed_token_ids"),
        ({"extra_body": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
        ({"extra_body": {"min_tokens": 3}}, "min_tokens must be less than or equal to max_tokens=2, got 3."),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(tmp_path, model_dir, fields, param):
    async def scenario(client, services):
        with pytest.raises(openai.BadRequestError) as error:
            await sdk(client).completions.create(model="tiny", prompt="x", max_tokens=2, **fields)
        return error.value

    error = run(tmp_path, model_dir, scenario)
    assert error.status_code == 400 and param in error.message


@pytest.mark.slow
def test_vllm_stop_fields_and_stop_reason(tmp_path, model_dir):
    """vLLM's stop_token_ids, min_tokens and include_stop_str_in_output work, and each choice says what
    stopped it in vLLM's `stop_reason` (the token id or the string; null for length)."""

    async def scenario(client, services):
        api = sdk(client)
        base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        plain = await api.completions.create(
            **base, extra_body={"ignore_eos": True, "return_token_ids": True}
        )
        ids = plain.choices[0].model_extra["token_ids"]
        by_token = await api.completions.create(**base, extra_body={"stop_token_ids": [ids[0]]})
        held = await api.completions.create(
            **base, extra_body={"stop_token_ids": [ids[0]], "min_tokens": 8, "ignore_eos": True}
        )
        stop = services.tokenizer.decode(ids[2:4])
        cut = await api.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
        kept = await api.completions.create(
            **base, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
        )
        chat = await api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        return plain, ids, by_token, held, stop, cut, kept, chat

    plain, ids, by_token, held, stop, cut, kept, chat = run(tmp_path, model_dir, scenario)
    first = by_token.choices[0]
    assert first.finish_reason == "stop" and first.model_extra["stop_reason"] == ids[0]
    assert by_token.usage.completion_tokens == 1
    assert held.usage.completion_tokens == 8  # min_tokens keeps the stop token from ending it
    assert plain.choices[0].model_extra["stop_reason"] is None  # length
    text = plain.choices[0].text
    assert (
        cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].model_extra["stop_reason"] == stop
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    assert "stop_reason" in chat.choices[0].model_extra
