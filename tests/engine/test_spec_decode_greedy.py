"""Speculative decoding keeps greedy requests exact: the same tokens as without speculation, with n-gram
and draft-model proposals, adapters mixed in one batch, through chunked prefill, preemption and prefix
caching; and proposals really were accepted (and rejected) on the way."""

from __future__ import annotations

import pytest
from spec_decode_fixtures import EOS, echo_prompts, make_echo_case

from engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# The fallback would pause requests of this random model now and then; these tests want every draft.
NO_FALLBACK = {"fallback_acceptance_rate": 0.0}
BASE = dict(skip_tokenizer_init=True, max_model_len=96, block_size=4, max_loras=2, max_lora_rank=8)
SETTINGS = {
    "mixed": dict(max_num_seqs=8),
    # Budget 8 for 6 requests: prompts are chunked, and decodes' proposals are cut to what fits.
    "chunked_prefill": dict(max_num_seqs=8, max_num_batched_tokens=8),
    # 20 blocks of 4 tokens for 6 requests of up to 48 tokens: requests are preempted and recomputed.
    "preemption": dict(max_num_seqs=8, num_kv_blocks=20, max_model_len=64),
    # Every prompt starts with the same 12 tokens: later requests hit the first one's blocks.
    "prefix_caching": dict(max_num_seqs=2),
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_echo_case(tmp_path_factory.mktemp("spec-greedy"))


def _requests(case, setting: str):
    shared = [3, 5, 7, 2, 4, 6, 1, 3, 5, 7, 2, 4] if setting == "prefix_caching" else None
    prompts = echo_prompts(6, shared_prefix=shared)
    names = [*case["adapters"], None]
    adapters = [names[i % 3] for i in range(len(prompts))]
    # Some requests stop at eos (possibly in the middle of accepted proposals), the rest run to max_tokens.
    params = [
        SamplingParams(temperature=0.0, max_tokens=32 + i % 3, ignore_eos=i % 2 == 0)
        for i in range(len(prompts))
    ]
    return prompts, params, adapters


def _generate(case, setting: str, speculative_config=None):
    llm = LLM(
        str(case["model"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        speculative_config=speculative_config,
        **{**BASE, **SETTINGS[setting]},
    )
    prompts, params, adapters = _requests(case, setting)
    outputs = llm.generate(prompts, params, adapters)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm.engine


def _check_setting(engine, setting: str) -> None:
    """The setting did what it is named for (else the comparison would prove little)."""
    stats = engine.stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    if setting == "prefix_caching":
        assert stats.num_prefix_cache_hits > 0


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ngram_greedy_tokens_identical(case, setting):
    expected, _ = _generate(case, setting)
    got, engine = _generate(case, setting, {**NGRAM, **NO_FALLBACK})
    assert got == expected
    assert any(EOS in tokens for tokens in expected)  # some stopped at eos
    _check_setting(engine, setting)
    spec = engine.stats().spec_decode
    assert spec.num_drafts > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # accepted and rejected proposals
    assert spec.num_accepted_tokens_per_pos[1] > 0  # runs of more than one accepted proposal


@pytest.mark.parametrize("setting", ["mixed", "preemption", "chunked_prefill"])
def test_draft_model_greedy_tokens_identical(case, setting):
    expected, _ = _generate(case, setting)
    config = {
        "method": "draft_model",
        "model": str(case["other"]),
        "num_speculative_tokens": 3,
        **NO_FALLBACK,
    }
    got, engine = _generate(case, setting, config)
    assert got == expected
    _check_setting(engine, setting)
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_draft_model_that_is_the_target_is_always_right(case):
    """The target as its own draft: for base-model requests every proposal is accepted, which holds only
    if the draft's KV cache follows the target's through catch-up, rollback and the full-acceptance lag."""
    llm = LLM(
        str(case["model"]),
        speculative_config={
            "method": "draft_model",
            "model": str(case["model"]),
            "num_speculative_tokens": 4,
        },
        **BASE,
        max_num_seqs=8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(echo_prompts(6), params)
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > 40
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    baseline = LLM(str(case["model"]), **BASE, max_num_seqs=8).generate(echo_prompts(6), params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in baseline]


def test_logprobs_match_without_speculation(case):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    runs = []
    for config in (None, {**NGRAM, **NO_FALLBACK}):
        llm = LLM(str(case["model"]), speculative_config=config, **BASE, max_num_seqs=8)
        runs.append(llm.generate(echo_prompts(4), params))
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    for plain, spec in zip(*runs):
        plain, spec = plain.outputs[0], spec.outputs[0]
        assert spec.token_ids == plain.token_ids
        assert [lp.token_id for lp in spec.logprobs] == plain.token_ids
        for a, b in zip(plain.logprobs, spec.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert list(a.top) == list(b.top)


def test_opted_out_requests_never_speculate(case):
    llm = LLM(str(case["model"]), speculative_config={**NGRAM, **NO_FALLBACK}, **BASE, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, speculative=False)
    llm.generate(echo_prompts(4), params)
    assert llm.engine.stats().spec_decode.num_drafts == 0
    llm.generate(echo_prompts(4), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_low_acceptance_falls_back(case):
    """Requiring every proposal to be accepted, over windows of 2 verifications, pauses the requests of a
    model whose proposals are often wrong: far fewer drafts than with the fallback off."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    drafts = {}
    for rate in (0.0, 1.0):
        config = {**NGRAM, "fallback_acceptance_rate": rate, "fallback_window": 2, "fallback_cooldown": 1000}
        llm = LLM(str(case["model"]), speculative_config=config, **BASE, max_num_seqs=8)
        llm.generate(echo_prompts(6), params)
        drafts[rate] = llm.engine.stats().spec_decode.num_drafts
        if rate:
            assert llm.engine.speculator.fallback.num_fallbacks > 0
    assert drafts[1.0] < drafts[0.0] / 2
