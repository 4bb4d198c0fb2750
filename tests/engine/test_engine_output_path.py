"""LLMEngine's output path is the front end's (engine/frontend/output_processor.py) over the core's token
deltas: cumulative outputs are the delta outputs joined, a stop string ends a request in the front end
and frees its sequence in the core, and an n > 1 request's prompt is counted once."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

ENGINE_ARGS = dict(max_loras=2, max_lora_rank=8, max_model_len=96, block_size=4)
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def engines(text_model_dir):
    config = EngineConfig(model=str(text_model_dir), **ENGINE_ARGS)
    cumulative, delta = LLMEngine(config), LLMEngine(config, output_kind="delta")
    try:
        yield cumulative, delta
    finally:
        cumulative.shutdown()
        delta.shutdown()


def run(engine: LLMEngine, request_id: str, params: SamplingParams, prompt=PROMPT) -> list:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_cumulative_outputs_are_the_delta_outputs_joined(engines):
    cumulative, delta = engines
    greedy = run(cumulative, "probe", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    text = greedy[-1].outputs[0].text
    stop = text[4:6]  # ends both (greedy) children part-way
    assert stop and stop in text
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, n=2, logprobs=1, prompt_logprobs=1, stop=[stop]
    )
    whole = run(cumulative, "c", params)
    parts = run(delta, "d", params)
    final = whole[-1]
    assert final.finished and not any(o.finished for o in whole[:-1])
    assert parts[-1].finished and not any(o.finished for o in parts[:-1])
    assert [o.prompt_logprobs is not None for o in parts].count(True) == 1  # once, in delta outputs
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == len(final.prompt_token_ids)
    for completion in final.outputs:
        mine = [c for o in parts for c in o.outputs if c.index == completion.index]
        assert "".join(c.text for c in mine) == completion.text
        assert sum((c.token_ids for c in mine), []) == completion.token_ids
        assert sum((c.logprobs for c in mine), []) == completion.logprobs
        assert mine[-1].cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert completion.text == text[: text.index(stop)]  # the stop string and what followed are cut
    assert [c.index for c in final.outputs] == [0, 1]


def test_a_stop_string_ends_the_sequence_in_the_core_too(engines):
    engine, _ = engines
    greedy = run(engine, "probe-2", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = greedy[-1].outputs[0].text[3:5]
    engine.add_request(
        "s", PROMPT, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[stop])
    )
    finished = None
    while finished is None:
        finished = next((o for o in engine.step() if o.finished), None)
    assert finished.outputs[0].stop_reason == stop and len(finished.outputs[0].token_ids) < 60
    while engine.has_unfinished_requests():  # the core's own end of it: an abort the front end ignores
        assert engine.step() == []
    assert engine.scheduler.num_running == 0 and engine.kv_cache.usage == 0.0


def test_an_n_request_counts_its_prompt_once(engines):
    engine, _ = engines
    before = engine.stats()
    run(engine, "n3", SamplingParams(temperature=0.8, seed=3, max_tokens=2, ignore_eos=True, n=3), [5, 6, 7])
    after = engine.stats()
    assert after.num_prompt_tokens - before.num_prompt_tokens == 3
    assert after.num_generation_tokens - before.num_generation_tokens == 6


def test_an_id_that_is_another_requests_child_id_is_refused(engines):
    """`x#0` in flight, then `x` with n=2 (whose first child is `x#0`): refused, and `x#0` still ends."""
    cumulative, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cumulative.add_request("x#0", PROMPT, params)
    with pytest.raises(ValueError, match="already in use"):
        cumulative.add_request(
            "x", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True)
        )
    finished = []
    for _ in range(50):
        if not cumulative.has_unfinished_requests():
            break
        finished += [o.request_id for o in cumulative.step() if o.finished]
    assert finished == ["x#0"] and not cumulative.has_unfinished_requests()
