"""check_stop: eos, stop token ids, stop strings, min_tokens, max_tokens and the context length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.stop_checker import StopResult, check_stop, may_stop_at, stop_token_reason

EOS = 2
PROMPT = [5, 6, 7, 8]
MAX_MODEL_LEN = 64
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH


def run_check(outputs, params=None, stop_string=None, max_model_len=MAX_MODEL_LEN, num_new=1):
    """Append `outputs` to a fresh request, then check the last `num_new` of them."""
    request = Request("r", list(PROMPT), params or SamplingParams(max_tokens=None), eos_token_id=EOS)
    for token_id in outputs:
        request.append_output_token(token_id)
    detokenizer = SimpleNamespace(stop_string=stop_string)
    return check_stop(request, detokenizer, outputs[len(outputs) - num_new :], max_model_len)


CASES = [
    # (name, outputs, params, stop_string, max_model_len, expected)
    ("running", [9, 10], {}, None, MAX_MODEL_LEN, None),
    ("eos", [9, EOS], {}, None, MAX_MODEL_LEN, StopResult(STOPPED, None)),
    ("eos ignored", [9, EOS], {"ignore_eos": True}, None, MAX_MODEL_LEN, None),
    ("stop token id", [9, 11], {"stop_token_ids": [11, 12]}, None, MAX_MODEL_LEN, StopResult(STOPPED, 11)),
    (
        "stop token id with ignore_eos",
        [11],
        {"stop_token_ids": [11], "ignore_eos": True},
        None,
        MAX_MODEL_LEN,
        StopResult(STOPPED, 11),
    ),
    ("stop string", [9, 10], {"stop": ["ab"]}, "ab", MAX_MODEL_LEN, StopResult(STOPPED, "ab")),
    ("max_tokens", [9, 10, 11], {"max_tokens": 3}, None, MAX_MODEL_LEN, StopResult(LENGTH)),
    ("below max_tokens", [9, 10], {"max_tokens": 3}, None, MAX_MODEL_LEN, None),
    ("max_model_len", [9, 10], {}, None, len(PROMPT) + 2, StopResult(LENGTH)),
    ("below max_model_len", [9, 10], {}, None, len(PROMPT) + 3, None),
    ("eos beats max_tokens", [9, EOS], {"max_tokens": 2}, None, MAX_MODEL_LEN, StopResult(STOPPED, None)),
    ("stop string beats length", [9], {"max_tokens": 1}, "x", MAX_MODEL_LEN, StopResult(STOPPED, "x")),
    ("eos within min_tokens", [9, EOS], {"min_tokens": 2}, None, MAX_MODEL_LEN, None),
    ("eos right after min_tokens", [9, 9, EOS], {"min_tokens": 2}, None, MAX_MODEL_LEN, StopResult(STOPPED)),
    ("stop id within min_tokens", [11], {"min_tokens": 1, "stop_token_ids": [11]}, None, MAX_MODEL_LEN, None),
    (
        "length ignores min_tokens",
        [9, 9],
        {"min_tokens": 5, "max_tokens": 2},
        None,
        MAX_MODEL_LEN,
        StopResult(LENGTH),
    ),
]


@pytest.mark.parametrize(
    "outputs, params, stop_string, max_model_len, expected",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_check_stop(outputs, params, stop_string, max_model_len, expected):
    params = SamplingParams(**{"max_tokens": None, **params})
    assert run_check(outputs, params, stop_string, max_model_len) == expected


def test_first_stop_among_several_new_tokens_counts():
    params = SamplingParams(max_tokens=None, stop_token_ids=[11, 12], min_tokens=1)
    # Token 11 is the first output (inside min_tokens), 12 the second: 12 stops.
    assert run_check([11, 12, EOS], params, num_new=3) == StopResult(STOPPED, 12)


def test_no_detokenizer():
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=None), eos_token_id=EOS)
    request.append_output_token(EOS)
    assert check_stop(request, None, [EOS], MAX_MODEL_LEN) == StopResult(STOPPED)


def test_no_eos_token_id():
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=None), eos_token_id=None)
    request.append_output_token(EOS)
    assert check_stop(request, None, [EOS], MAX_MODEL_LEN) is None


@pytest.mark.parametrize("status, finish_reason", [(STOPPED, "stop"), (LENGTH, "length")])
def test_finish_reason(status, finish_reason):
    assert StopResult(status).finish_reason == finish_reason == status.finish_reason


@pytest.mark.parametrize(
    "num_output_tokens, min_tokens, expected",
    [(1, 0, True), (1, 1, False), (2, 1, True), (3, 3, False), (4, 3, True)],
)
def test_may_stop_at(num_output_tokens, min_tokens, expected):
    assert may_stop_at(num_output_tokens, SamplingParams(min_tokens=min_tokens)) is expected


@pytest.mark.parametrize(
    "token_id, params, eos, expected",
    [
        (EOS, {}, EOS, (True, None)),
        (EOS, {"ignore_eos": True}, EOS, (False, None)),
        (EOS, {}, None, (False, None)),
        (11, {"stop_token_ids": [11]}, EOS, (True, 11)),
        (EOS, {"stop_token_ids": [EOS]}, EOS, (True, EOS)),  # listed explicitly: reported as a stop id
        (9, {"stop_token_ids": [11]}, EOS, (False, None)),
    ],
)
def test_stop_token_reason(token_id, params, eos, expected):
    assert stop_token_reason(token_id, SamplingParams(**params), eos) == expected
