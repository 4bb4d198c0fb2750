"""Engine behaviour per request: failures that stay local, seeds, n, logprobs, stops, prefix caching."""

from __future__ import annotations

import pytest
from factories import make_adapter, make_model

from engine import RequestMeta, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _bad_adapters(text_model_dir, tmp_path):
    too_big = make_adapter(
        text_model_dir, tmp_path / "rank32", r=32, lora_alpha=32, target_modules=["q_proj"]
    )
    other_dir = make_model(tmp_path / "other", hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    wrong_shape = make_adapter(other_dir, tmp_path / "wrong", r=4, lora_alpha=4, target_modules=["q_proj"])
    return too_big, wrong_shape


def test_bad_requests_fail_alone(llm, text_model_dir, tmp_path):
    too_big, wrong_shape = _bad_adapters(text_model_dir, tmp_path)
    good = ["The quick brown fox", "café crème"]
    baseline = llm.generate(good, GREEDY, adapters=["alpha", None])
    prompts = [good[0], "x " * 200, good[1], "hello", "hello", "hello"]
    adapters = ["alpha", None, None, "no-such-adapter", str(too_big), str(wrong_shape)]
    outputs = llm.generate(prompts, GREEDY, adapters=adapters)
    assert [o.outputs[0].token_ids for o in (outputs[0], outputs[2])] == [
        b.outputs[0].token_ids for b in baseline
    ]
    errors = [o.error for o in outputs]
    assert errors[0] is None and errors[2] is None
    assert "max_model_len" in errors[1] and "tokens" in errors[1]
    assert "unknown adapter 'no-such-adapter'" in errors[3]
    assert "max_lora_rank" in errors[4]
    assert "do not fit the base model" in errors[5]
    assert all(outputs[i].outputs[0].finish_reason == "error" for i in (1, 3, 4, 5))
    # The engine still serves afterwards.
    assert (
        llm.generate(good[:1], GREEDY, adapters=["alpha"])[0].outputs[0].token_ids
        == baseline[0].outputs[0].token_ids
    )


def test_same_seed_same_tokens_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["Hello world"], seeded)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["The end.", "Hello world", "你好世界"],
        [SamplingParams(temperature=1.0, max_tokens=10), seeded, SamplingParams(temperature=0.7, seed=5)],
        adapters=["beta", None, "alpha"],
    )
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate(["Hello world"], other_seed)[0].outputs[0].token_ids != alone


def test_n_completions_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=3, ignore_eos=True)
    (output,) = llm.generate(["Hello"], params, adapters=["beta"])
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for token_id, lp in zip(completion.token_ids, completion.logprobs):
            assert lp.token_id == token_id and lp.logprob <= 0.0
            assert len(lp.top) == 3 and list(lp.top.values()) == sorted(lp.top.values(), reverse=True)
        assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))


def test_greedy_logprobs_top1_is_the_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    completion = llm.generate(["Hello"], params)[0].outputs[0]
    for token_id, lp in zip(completion.token_ids, completion.logprobs):
        assert next(iter(lp.top)) == token_id


def test_stop_string_truncates_text(llm):
    free = llm.generate(["The quick"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    stopped = llm.generate(
        ["The quick"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    completion = stopped[0].outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


def test_stop_token_ids_and_length(llm):
    free = llm.generate(["The quick"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[
        0
    ].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_id = free.token_ids[4]
    cut = llm.generate(
        ["The quick"],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    first = free.token_ids.index(stop_id)
    assert cut.token_ids == free.token_ids[: first + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id


def test_max_model_len_ends_with_length(llm):
    prompt = list(range(2, 90))  # 88 tokens of 96
    completion = llm.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 96 - 88


def test_prefix_cache_hits_per_adapter_only(llm):
    prompt = "naïve résumé, déjà vu: café crème brûlée! " * 2  # shares no block with other tests' prompts
    first = llm.generate([prompt], GREEDY, adapters=["alpha"])[0]
    again = llm.generate([prompt], GREEDY, adapters=["alpha"])[0]
    other = llm.generate([prompt], GREEDY, adapters=["beta"])[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert len({tuple(o.outputs[0].token_ids) for o in (first, other, base)}) == 3


def test_a_seed_torch_refuses_is_refused_up_front():
    for seed in (2**64, 2**63, -(2**63) - 1, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63))


def test_a_request_whose_sampling_raises_fails_alone(llm, monkeypatch):
    """A fault in one request's sampling mid-generation (here: its generator raises on its fourth token)
    fails that request alone; the others keep exactly the tokens they get without it, seeded ones too."""
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    prompts = ["Hello world", "The end.", "café crème"]
    params = [seeded, GREEDY, SamplingParams(temperature=0.8, seed=666, max_tokens=10, ignore_eos=True)]
    baseline = llm.generate(prompts[:2], params[:2], adapters=["alpha", None])
    sampler = llm.engine.sampler
    real = sampler._request_generator

    def faulty(request, device):
        if request.sampling_params.seed == 666 and request.num_output_tokens + request.num_in_flight == 3:
            raise RuntimeError("Overflow when unpacking long long")
        return real(request, device)

    monkeypatch.setattr(sampler, "_request_generator", faulty)
    outputs = llm.generate(prompts, params, adapters=["alpha", None, "beta"])
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [b.outputs[0].token_ids for b in baseline]
    failed = outputs[2]
    assert failed.outputs[0].finish_reason == "error" and "failed while generating" in failed.error
    assert len(failed.outputs[0].token_ids) == 3
    assert llm.generate(prompts[1:2], GREEDY)[0].outputs[0].token_ids == baseline[1].outputs[0].token_ids


def test_a_seed_changed_after_validation_fails_its_request_alone(llm):
    good = llm.generate(["The end."], GREEDY)[0].outputs[0].token_ids
    poisoned = SamplingParams(temperature=0.8, seed=1, max_tokens=10)
    poisoned.seed = 2**64
    outputs = llm.generate(["Hello", "The end."], [poisoned, GREEDY])
    assert outputs[0].outputs[0].finish_reason == "error" and "seed" in outputs[0].error
    assert outputs[1].outputs[0].token_ids == good


def test_tenant_and_weight_reach_the_scheduler_and_its_accounting(llm):
    engine = llm.engine
    before = {t.tenant: t for t in engine.stats().tenants}.get("default")
    engine.add_request("fair-1", [5, 6, 7, 8], GREEDY, None, meta=RequestMeta(tenant="acme", tenant_weight=3))
    engine.add_request("fair-2", [5, 6, 7], SamplingParams(max_tokens=2, n=2, ignore_eos=True), None)
    while engine.has_unfinished_requests():
        engine.step()
    tenants = {t.tenant: t for t in engine.stats().tenants}
    acme, default = tenants["acme"], tenants["default"]
    assert (acme.weight, acme.num_prompt_tokens, acme.num_generation_tokens) == (3.0, 4, 12)
    assert acme.virtual_tokens >= (4 * 1.0 + 12 * 2.0) / 3 - 1e-9
    # No tenant given: the shared default key; each of the n = 2 completions pays its prompt.
    counts = (default.num_requests, default.num_prompt_tokens, default.num_generation_tokens)
    earlier = (
        (before.num_requests, before.num_prompt_tokens, before.num_generation_tokens) if before else (0, 0, 0)
    )
    assert [now - then for now, then in zip(counts, earlier)] == [2, 6, 4]
    for bad in ("", 7):
        with pytest.raises(ValueError, match="tenant"):
            RequestMeta(tenant=bad)
    for weight in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="tenant_weight"):
            RequestMeta(tenant="acme", tenant_weight=weight)


@pytest.fixture(scope="module")
def llm(mixed_llm):
    return mixed_llm
