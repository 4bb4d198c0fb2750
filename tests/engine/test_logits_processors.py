"""Penalties, logit_bias, allowed_token_ids and min_p against a float64 reference of their definitions,
and through the engine: a request's edits touch its own row only."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.logits_processors import apply_logits_processors
from engine.request import Request

VOCAB = 50


def _request(params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    request = Request("r", prompt, params)
    for token in output:
        request.append_output_token(token)
    return request


def _reference(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """Each edit written out per token, in float64."""
    out = [float(x) for x in logits]
    counts = Counter(output)
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t, n in counts.items():
        out[t] -= params.presence_penalty + params.frequency_penalty * n
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    if params.allowed_token_ids is not None:
        out = [x if t in params.allowed_token_ids else -math.inf for t, x in enumerate(out)]
    if params.min_p > 0 and not params.greedy:
        floor = max(out) + params.temperature * math.log(params.min_p)
        out = [x if x >= floor else -math.inf for x in out]
    return out


CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3),
    SamplingParams(logit_bias={3: 100.0, 7: -100.0, 9: 0.5}),
    SamplingParams(allowed_token_ids=[1, 4, 9, 16]),
    SamplingParams(temperature=0.7, min_p=0.2),
    SamplingParams(
        temperature=1.0, min_p=0.05, repetition_penalty=1.2, frequency_penalty=1.0, logit_bias={2: 5.0}
    ),
]


@pytest.mark.parametrize("params", CASES)
def test_edits_equal_the_float64_reference(params):
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, VOCAB, (12,), generator=generator).tolist()
    output = torch.randint(0, VOCAB, (9,), generator=generator).tolist()
    logits = torch.randn(3, VOCAB, generator=generator, dtype=torch.float64) * 3
    untouched = logits.clone()
    requests = [
        _request(SamplingParams(), prompt, output),
        _request(params, prompt, output),
        _request(SamplingParams(temperature=0.5), prompt, output),
    ]
    apply_logits_processors(logits, requests)
    expected = torch.tensor(_reference(untouched[1].tolist(), params, prompt, output), dtype=torch.float64)
    torch.testing.assert_close(logits[1], expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(logits[0], untouched[0]) and torch.equal(logits[2], untouched[2])


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"repetition_penalty": 0.0}, ["repetition_penalty"]),
        ({"presence_penalty": 2.5}, ["presence_penalty"]),
        ({"frequency_penalty": -3}, ["frequency_penalty"]),
        ({"min_p": 1.5}, ["min_p"]),
        ({"logit_bias": {1: 101}}, ["logit_bias"]),
        ({"allowed_token_ids": []}, ["allowed_token_ids"]),
    ],
)
def test_out_of_range_values_are_refused(fields, words):
    with pytest.raises(ValueError) as error:
        SamplingParams(**fields)
    for word in words:
        assert word in str(error.value)


def test_through_the_engine(text_model_dir):
    llm = LLM(model=str(text_model_dir), max_model_len=64, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(["Hello"], greedy)[0].outputs[0].token_ids
    only = [5, 6, 7]
    outputs = llm.generate(
        ["Hello", "Hello", "Hello", "Hello"],
        [
            greedy,
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=only),
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100}),
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=100.0),
        ],
    )
    assert outputs[0].outputs[0].token_ids == plain
    assert set(outputs[1].outputs[0].token_ids) <= set(only)
    assert outputs[2].outputs[0].token_ids == [42] * 6
    repeated = outputs[3].outputs[0].token_ids
    assert len(set(repeated)) == len(repeated)  # a huge penalty never picks a token twice
    bad = llm.generate(["Hello"], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))[0]
    assert bad.outputs[0].finish_reason == "error" and "logit_bias" in bad.error and "vocabulary" in bad.error
