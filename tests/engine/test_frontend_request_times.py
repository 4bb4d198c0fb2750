"""The front end's half of prompt logprobs and request times: prompt logprobs go out once, in the first
delta; a request's times come from the core's last delta, or, when a stop string ends it in the front end
(before the core knows), from the core's first-token times extended by the front end's clock."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import byte_level_bpe_tokenizer

from engine import SamplingParams
from engine.frontend.output_processor import RequestProcessor
from engine.messages import RequestDelta
from engine.outputs import RequestTimes
from engine.prompt_logprobs import PromptTokenLogprobs

FIRST = RequestTimes(queue=0.5, prefill=0.25, decode=0.0, inference=0.25)
ENTRIES = [None, PromptTokenLogprobs(7, -1.5, 3, {9: -0.5})]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_bpe_tokenizer()


def processor(tokenizer, **params) -> RequestProcessor:
    return RequestProcessor("r", None, [5, 7], SamplingParams(**params), None, tokenizer, [0])


def test_prompt_logprobs_once_and_the_cores_final_times(tokenizer):
    request = processor(tokenizer, max_tokens=3, prompt_logprobs=1)
    first, _ = request.process([RequestDelta("r", [40], prompt_logprobs=ENTRIES, times=FIRST)])
    assert first.prompt_logprobs == ENTRIES and first.outputs[0].times is None  # not finished yet
    second, _ = request.process([RequestDelta("r", [41])])
    assert second.prompt_logprobs is None
    final = RequestTimes(queue=0.5, prefill=0.25, decode=0.125, inference=0.375)
    last, _ = request.process([RequestDelta("r", [42], finish_reason="length", times=final)])
    assert last.finished and last.outputs[0].times == final


def test_a_stop_string_extends_the_first_token_times(tokenizer):
    stop_text = tokenizer.decode([41])
    request = processor(tokenizer, max_tokens=8, stop=[stop_text])
    request.process([RequestDelta("r", [40], times=FIRST)])
    output, to_abort = request.process([RequestDelta("r", [41])])
    assert to_abort == ["r"] and output.outputs[0].finish_reason == "stop"
    times = output.outputs[0].times
    assert (times.queue, times.prefill) == (FIRST.queue, FIRST.prefill)
    assert times.decode >= 0 and times.inference == pytest.approx(times.prefill + times.decode)
