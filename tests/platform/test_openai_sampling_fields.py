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
    ],
)
def test_bad_values_are_400s_naming_the_field(tmp_path, model_dir, fields, param):
    async def scenario(client, services):
        with pytest.raises(openai.BadRequestError) as error:
            await sdk(client).completions.create(model="tiny", prompt="x", max_tokens=2, **fields)
        return error.value

    error = run(tmp_path, model_dir, scenario)
    assert error.status_code == 400 and param in error.message
