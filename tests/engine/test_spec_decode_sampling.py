"""Speculative decoding keeps sampled requests on the target's distribution: seeded requests produce
the very tokens they produce without speculation, and over many unseeded and seeded requests the joint
distribution of two sampled tokens (the second verified against an n-gram proposal) matches the
target's exact one (a chi-square test on a vocabulary of 8 tokens)."""

from __future__ import annotations

import pytest
import torch
from spec_decode_fixtures import VOCAB, echo_prompts, make_echo_case
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "fallback_acceptance_rate": 0.0,
}
BASE = dict(skip_tokenizer_init=True, max_model_len=96, block_size=4, max_loras=2, max_lora_rank=8)
# Every token of the vocabulary occurs in it followed by another, so n-gram lookup always proposes.
STAT_PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 0, 2, 7, 4]
TEMPERATURE = 1.3  # flattens the random model's distributions: more cells with enough samples
NUM_SAMPLES = 1200
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled, as the chi-square approximation needs


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_echo_case(tmp_path_factory.mktemp("spec-sampling"))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_requests_identical_with_and_without_speculation(case, method):
    config = NGRAM
    if method == "draft_model":
        config = {"method": "draft_model", "model": str(case["other"]), "num_speculative_tokens": 3}
        config["fallback_acceptance_rate"] = 0.0
    prompts = echo_prompts(6)
    names = [*case["adapters"], None]
    adapters = [names[i % 3] for i in range(len(prompts))]
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.95 if i % 2 else 1.0,
            top_k=6 if i % 3 == 0 else 0,
            seed=100 + i,
            max_tokens=32,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    runs = []
    for speculative_config in (None, config):
        llm = LLM(
            str(case["model"]),
            lora_modules={k: str(v) for k, v in case["adapters"].items()},
            speculative_config=speculative_config,
            **BASE,
            max_num_seqs=8,
        )
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, adapters)])
    assert runs[0] == runs[1]
    spec = llm.engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def _target_joint(model_dir) -> torch.Tensor:
    """P(t1, t2) after STAT_PROMPT at TEMPERATURE, from transformers [VOCAB, VOCAB] float64."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        first = model(torch.tensor([STAT_PROMPT])).logits[0, -1].double()
        continued = torch.tensor([[*STAT_PROMPT, t] for t in range(VOCAB)])
        second = model(continued).logits[:, -1].double()  # [VOCAB, VOCAB]
    p1 = (first / TEMPERATURE).softmax(-1)
    p2 = (second / TEMPERATURE).softmax(-1)
    return p1[:, None] * p2


def _chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test with cells expected fewer than MIN_EXPECTED times pooled into one."""
    counts, expected = counts.flatten().double(), expected.flatten()
    small = expected < MIN_EXPECTED
    observed = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    wanted = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    statistic = ((observed - wanted) ** 2 / wanted).sum()
    df = torch.tensor(len(wanted) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


def test_sampled_distribution_equals_the_targets(case):
    llm = LLM(
        str(case["model"]),
        speculative_config=NGRAM,
        **BASE,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        num_kv_blocks=128 * 5 + 8,
        seed=7,
    )
    # max_tokens 3: the second token is verified against one proposal (k is capped by max_tokens).
    # Even requests are seeded (their generators are rewound past unused rows), odd ones share one.
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True, seed=i if i % 2 == 0 else None)
        for i in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([{"prompt_token_ids": STAT_PROMPT}] * NUM_SAMPLES, params)
    counts = torch.zeros(VOCAB, VOCAB)
    for output in outputs:
        t1, t2 = output.outputs[0].token_ids[:2]
        counts[t1, t2] += 1
    spec = llm.engine.stats().spec_decode
    assert spec.num_drafts >= NUM_SAMPLES  # every request verified a proposal for its second token
    assert 0.05 * spec.num_draft_tokens < spec.num_accepted_tokens < 0.95 * spec.num_draft_tokens
    expected = _target_joint(case["model"]) * NUM_SAMPLES
    assert (expected >= MIN_EXPECTED).sum() >= 10  # enough cells for the test to have power
    p_value = _chi_square_p_value(counts, expected)
    print(f"chi-square p-value {p_value:.4f}")
    assert p_value > 1e-3
