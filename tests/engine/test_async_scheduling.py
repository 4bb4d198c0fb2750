"""Async scheduling (the next step launched before the host reads the sampled tokens) gives the outputs of
the synchronous engine: greedy and seeded tokens, stops, lengths, logprobs, n > 1, preemption, aborts."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, input_batch
from engine.config import EngineConfig

PROMPTS = [
    "The quick brown fox",
    "hello there",
    "café crème",
    "one two three four five",
    "a",
    "The end.",
    "x y z",
    "Lorem ipsum dolor sit amet",
]
ADAPTERS = ["alpha", None, "beta", "alpha", None, "beta", None, "alpha"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12),  # may stop on eos
    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=9),
    SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=16, stop=["e"]),
    SamplingParams(temperature=0.0, max_tokens=7, min_tokens=5, repetition_penalty=1.3),  # reads tokens
    SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),  # up to max_model_len
]


def make(text_model_dir, text_adapters, async_scheduling: bool, **overrides) -> LLM:
    args = dict(
        model=str(text_model_dir),
        lora_modules={k: str(v) for k, v in text_adapters.items()},
        max_loras=2,
        max_lora_rank=8,
        max_model_len=48,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    return LLM(**{**args, **overrides})


def summary(outputs) -> list:
    """Everything but logprob values: a finished request's wasted row in the next step changes the batch,
    and so float32 rounding (values agree to 1e-4; tokens and the top-n ids exactly)."""
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason, _top_ids(c.logprobs)) for c in o.outputs]
        + [o.error, o.finished]
        for o in outputs
    ]


def _top_ids(logprobs):
    return None if logprobs is None else [(lp.token_id, list(lp.top)) for lp in logprobs]


def logprob_values(outputs) -> list[float]:
    return [
        value
        for o in outputs
        for c in o.outputs
        for lp in c.logprobs or []
        for value in [lp.logprob, *lp.top.values()]
    ]


@pytest.mark.parametrize("overrides", [{}, {"num_kv_blocks": 13}], ids=["roomy", "preempting"])
def test_async_outputs_match_sync(text_model_dir, text_adapters, overrides, monkeypatch):
    sync = make(text_model_dir, text_adapters, False, **overrides)
    expected = sync.generate(PROMPTS, PARAMS, adapters=ADAPTERS)
    reads = []
    real = input_batch._read_in_flight

    def counting(input_ids, waiting, in_flight):
        reads.append(len(waiting))
        return real(input_ids, waiting, in_flight)

    monkeypatch.setattr(input_batch, "_read_in_flight", counting)
    llm = make(text_model_dir, text_adapters, True, **overrides)
    got = llm.generate(PROMPTS, PARAMS, adapters=ADAPTERS)
    assert summary(got) == summary(expected)
    assert logprob_values(got) == pytest.approx(logprob_values(expected), abs=1e-4)
    assert sum(reads) > 50, "decode inputs should come from the device"
    assert not llm.engine.has_unfinished_requests()
    if overrides:
        assert llm.engine.scheduler.num_preemptions > 0
        assert sync.engine.scheduler.num_preemptions > 0


def test_async_step_returns_the_previous_steps_tokens(text_model_dir, text_adapters):
    engine = make(text_model_dir, text_adapters, True).engine
    engine.add_request("r", "hello there", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert engine.step() == []  # the prefill ran; its token is still in flight
    assert engine.scheduler.running[0].num_in_flight == 1
    lengths = []
    while engine.has_unfinished_requests():
        lengths += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert lengths == [1, 2, 3, 4]
    assert engine.kv_cache.usage == 0.0


def test_abort_while_a_token_is_in_flight(text_model_dir, text_adapters):
    sync = make(text_model_dir, text_adapters, False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full = sync.generate(PROMPTS[:3], params)
    engine = make(text_model_dir, text_adapters, True).engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    final = {}
    for _ in range(6):
        for output in engine.step():
            final[output.request_id] = output
    engine.abort_request("1")
    while engine.has_unfinished_requests():
        for output in engine.step():
            final[output.request_id] = output
    aborted = final["1"].outputs[0]
    assert aborted.finish_reason == "abort"
    assert aborted.token_ids == full[1].outputs[0].token_ids[: len(aborted.token_ids)]
    assert [final[k].outputs[0].token_ids for k in ("0", "2")] == [
        full[i].outputs[0].token_ids for i in (0, 2)
    ]
    assert engine.kv_cache.usage == 0.0


def test_no_wasted_step_when_length_ends_a_request(text_model_dir, text_adapters, monkeypatch):
    """A token in flight that reaches max_tokens ends the request: it is not scheduled again."""
    engine = make(text_model_dir, text_adapters, True).engine
    rows = []
    real = engine.sampler.launch

    def counting(logits, requests):
        rows.append(len(requests))
        return real(logits, requests)

    monkeypatch.setattr(engine.sampler, "launch", counting)
    engine.add_request("r", "hello there", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert rows == [1, 1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_graph_replays_match_sync_on_the_gpu(text_model_dir, text_adapters, dtype):
    """CUDA graphs read the in-flight tokens from the device; with no stop token (ignore_eos) every step's
    batch is the same in both modes, so greedy tokens are identical even in bf16."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        llm = make(text_model_dir, text_adapters, async_scheduling, device="cuda", dtype=dtype)
        outputs = llm.generate(PROMPTS, params, adapters=ADAPTERS)
        assert llm.engine.runner.graphs.num_replays > 0
        assert llm.engine.stats().num_kernel_compiles_after_ready == 0
        results.append([o.outputs[0].token_ids for o in outputs])
    assert results[0] == results[1]


def test_async_scheduling_must_be_a_bool():
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig(model="m", async_scheduling="yes")
