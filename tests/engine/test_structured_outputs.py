"""Structured outputs through the engine: every constrained output follows its spec (to the end when the
request stops, as a valid prefix when it hits max_tokens), unconstrained neighbours in the same batch are
untouched, and an invalid spec fails its request alone with the problem named."""

from __future__ import annotations

import json
import re

import pytest

from engine import SamplingParams
from engine.structured_output import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def constrained(temperature: float = 0.0, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=7, max_tokens=40, structured_outputs=StructuredOutputsParams(**spec)
    )


def test_outputs_follow_their_specs_in_a_mixed_batch(llm):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    baseline = llm.generate(["Hello world", "The end."], free, adapters=["alpha", None])
    prompts = ["Hello world", "Pick:", "Digits:", "JSON:", "The end.", "Any JSON:", "Grammar:"]
    params = [
        free,
        constrained(choice=["yes", "no", "maybe later"]),
        constrained(temperature=1.0, regex=r"[0-9]{3}-[a-c]{2}"),
        constrained(temperature=0.8, json=SCHEMA),
        free,
        constrained(json_object=True),
        constrained(grammar='root ::= "(" ("x" | "y")+ ")"'),
    ]
    adapters = ["alpha", "beta", None, "alpha", None, "beta", None]
    outputs = llm.generate(prompts, params, adapters=adapters)
    assert outputs[0].outputs[0].token_ids == baseline[0].outputs[0].token_ids
    assert outputs[4].outputs[0].token_ids == baseline[1].outputs[0].token_ids
    texts = [o.outputs[0].text for o in outputs]
    finished = [o.outputs[0].finish_reason for o in outputs]
    assert texts[1] in {"yes", "no", "maybe later"} and finished[1] == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", texts[2]) and finished[2] == "stop"
    value = json.loads(texts[3])
    assert (
        value["color"] in {"red", "blue"} and isinstance(value["ok"], bool) and set(value) == {"color", "ok"}
    )
    assert texts[5].startswith("{")  # any JSON object: complete if it stopped, a prefix otherwise
    if finished[5] == "stop":
        assert isinstance(json.loads(texts[5]), dict)
    assert re.fullmatch(r"\((x|y)+\)?", texts[6])
    assert all(o.error is None for o in outputs)


def test_n_choices_each_follow_the_spec(llm):
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=20, structured_outputs={"regex": r"(ab|cd){2}!"}
    )
    (output,) = llm.generate(["Go"], params, adapters=["beta"])
    assert len(output.outputs) == 4
    for completion in output.outputs:
        assert re.fullmatch(r"(ab|cd){2}!", completion.text), completion.text


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json": '{"type": "object", "properties": '}, ["JSON schema", "not valid JSON"]),
        ({"json": "[1, 2]"}, ["schema must be an object"]),
        ({"regex": "(unclosed"}, ["regex"]),
        ({"grammar": "root ::= ("}, ["grammar"]),
    ],
)
def test_an_invalid_spec_fails_its_request_alone(llm, spec, words):
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(["Hello", "Hello"], [SamplingParams(structured_outputs=spec), good])
    assert outputs[0].outputs[0].finish_reason == "error"
    for word in words:
        assert word in outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "fields, words",
    [
        ({}, ["exactly one", "none"]),
        ({"regex": "a", "choice": ["b"]}, ["exactly one", "regex", "choice"]),
        ({"choice": []}, ["choice"]),
        ({"choice": ["a", ""]}, ["choice"]),
    ],
)
def test_params_take_exactly_one_valid_kind(fields, words):
    with pytest.raises(ValueError) as error:
        StructuredOutputsParams(**fields)
    for word in words:
        assert word in str(error.value)


@pytest.fixture(scope="module")
def llm(mixed_llm):
    return mixed_llm
