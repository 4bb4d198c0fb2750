"""Speculative decoding's pure parts: the config, n-gram lookup, the fallback, the logits rows, and the
scheduler's handling of proposals (cut by the budget, dropped before anyone is preempted)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.input_batch import _input_ids, _logits_rows
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.fallback import AcceptanceFallback
from engine.spec_decode.ngram import propose_ngram


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([5, 6, 7, 8, 9, 5, 6], 2, 2, 3, [7, 8, 9]),
        ([5, 6, 7, 8, 9, 5, 6], 1, 1, 2, [7, 8]),
        ([1, 2, 3], 1, 3, 2, []),  # the last token never occurred before
        ([1, 2, 3, 4, 2], 2, 3, 2, []),  # only a 1-token match, min_n 2
        ([4, 5, 6, 0, 4, 5, 6, 9, 5, 6], 2, 3, 2, [9, 5]),  # the latest of two equally long matches
        ([7, 5, 6, 1, 9, 5, 6, 2, 7, 5, 6], 2, 3, 2, [1, 9]),  # the longer match wins over the later one
        ([1, 1, 1, 1], 1, 3, 3, [1]),  # proposals stop at the end of the sequence
        ([2, 3, 2], 1, 2, 0, []),  # k 0
    ],
)
def test_propose_ngram(tokens, min_n, max_n, k, expected):
    assert propose_ngram(tokens, min_n, max_n, k) == expected


def test_config_parses_vllm_forms():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)  # vLLM: min defaults to max
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 5
    assert (
        SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 2}).method == "draft_model"
    )
    engine_config = EngineConfig(
        model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    )
    assert isinstance(engine_config.speculative_config, SpeculativeConfig)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "exceeds",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'model' is for method draft_model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "fallback_acceptance_rate": 2},
            "fallback_acceptance_rate",
        ),
        ("{not json", "not valid JSON"),
        ([1], "must be a JSON object"),
    ],
)
def test_config_refuses_bad_values(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_speculation_runs_steps_one_at_a_time():
    """A step's kept tokens decide the next step: speculative decoding turns async scheduling off."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert not EngineConfig(model="m", async_scheduling=True, speculative_config=spec).async_scheduling
    assert EngineConfig(model="m", async_scheduling=True).async_scheduling


def test_fallback_pauses_then_retries():
    fallback = AcceptanceFallback(min_rate=0.5, window=2, cooldown=3)
    assert fallback.allows("r")
    fallback.record("r", 4, 3)
    fallback.record("r", 4, 0)  # 3 of 8 accepted < 0.5
    assert [fallback.allows("r") for _ in range(4)] == [False, False, False, True]
    fallback.record("r", 4, 4)
    fallback.record("r", 4, 4)
    assert fallback.allows("r") and fallback.num_fallbacks == 1


def _request(request_id, prompt, spec=(), max_tokens=16):
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))
    request.spec_token_ids = list(spec)
    return request


def test_logits_rows_and_input_ids_of_a_mixed_step():
    prefill = _request("p", [1, 2, 3])
    decode = _request("d", [4, 5])
    verify = _request("v", [6, 7, 8], spec=[9, 9, 9, 9])
    scheduled = [
        ScheduledRequest(prefill, 2, 0, [0]),  # chunk 0..1 of 3: no sampling
        ScheduledRequest(decode, 1, 1, [1]),
        ScheduledRequest(verify, 5, 2, [2, 3], num_spec_tokens=4),
    ]
    ends = np.array([2, 3, 8])
    assert _logits_rows(scheduled, ends).tolist() == [2, 3, 4, 5, 6, 7]
    ids, waiting = _input_ids(scheduled)
    assert ids == [1, 2, 5, 8, 9, 9, 9, 9] and waiting == []
    assert scheduled[2].samples and not scheduled[0].samples


def _scheduler(num_blocks=32, **config):
    engine_config = EngineConfig(
        model="m", block_size=4, num_kv_blocks=num_blocks, enable_prefix_caching=False, **config
    )
    return Scheduler(engine_config, KVCacheManager(num_blocks, 4, False), 64)


def _decoding(scheduler, *requests):
    """Admit and prefill `requests` in one step, then give each one output token: they decode next."""
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    for request in requests:
        request.append_output_token(3)
    return requests


def test_scheduler_verifies_proposals_and_cuts_them_to_the_budget():
    scheduler = _scheduler(max_num_batched_tokens=6)
    a, b = _decoding(scheduler, _request("a", [1, 2, 3]), _request("b", [1, 2]))
    a.spec_token_ids, b.spec_token_ids = [5, 5, 5], [6, 6, 6]
    out = scheduler.schedule()
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert (by_id["a"].num_new_tokens, by_id["a"].num_spec_tokens) == (4, 3)
    assert (by_id["b"].num_new_tokens, by_id["b"].num_spec_tokens) == (2, 1)  # 6 - 4 left: one proposal
    assert b.spec_token_ids == [6] and by_id["b"].samples
    assert a.num_computed_tokens == a.num_tokens + 3  # the engine rolls back what is rejected


def test_proposals_are_dropped_before_anyone_is_preempted():
    # 3 blocks of 4: a (3 prompt + 1 output) fills one, b (4 + 1) two; a's 3 proposals would need a fourth.
    scheduler = _scheduler(num_blocks=3, max_num_batched_tokens=16)
    a, b = _decoding(
        scheduler, _request("a", [1, 2, 3], max_tokens=4), _request("b", [1, 2, 3, 4], max_tokens=4)
    )
    a.spec_token_ids = [5, 5, 5]
    out = scheduler.schedule()
    assert not out.preempted
    item = next(s for s in out.scheduled if s.request is a)
    assert (item.num_new_tokens, item.num_spec_tokens) == (1, 0) and a.spec_token_ids == []
    assert b.num_computed_tokens == b.num_tokens


def test_front_end_drops_tokens_after_a_stop_string_in_a_multi_token_delta():
    """A speculative step delivers several tokens at once; those after the one completing a stop string
    are not output (as when tokens come one per step)."""
    from tokenizer_fixtures import byte_level_bpe_tokenizer

    from engine.frontend.output_processor import RequestProcessor
    from engine.messages import RequestDelta

    tokenizer = byte_level_bpe_tokenizer()
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("ab", "cd", "ef", "gh")]
    ids = [t for w in words for t in w]
    stop_after = len(words[0]) + len(words[1])  # the tokens of "abcd"
    params = SamplingParams(max_tokens=16, stop=["cd"], logprobs=None)
    processor = RequestProcessor("r", None, [5, 6], params, None, tokenizer, [0])
    output, to_abort = processor.process([RequestDelta("r", ids)])
    completion = output.outputs[0]
    assert completion.text == "ab" and completion.finish_reason == "stop"
    assert completion.token_ids == ids[:stop_after]
    assert to_abort == ["r"]


def test_token_history_follows_the_request():
    from engine.spec_decode.ngram import TokenHistory

    history = TokenHistory()
    request = _request("h", range(1, 40))
    assert history.tokens(request).tolist() == list(range(1, 40))
    for token in range(200):  # grows past its buffer several times
        request.append_output_token(token)
        assert history.tokens(request).tolist() == request.all_token_ids
    history.free("h")
    assert history.tokens(request).tolist() == request.all_token_ids
