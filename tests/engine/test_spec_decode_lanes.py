"""The verification graphs' lane layout (spec_decode/verify_graphs.py), checked on the CPU: the graphs'
forward runs uncaptured on their static buffers with the interpreted Triton attention, and greedy tokens
stay those of decoding without speculation, adapters mixed, through padding lanes, ghost rows, chunked
prefill and preemption."""

from __future__ import annotations

import pytest
from factories import make_adapter, make_model
from spec_decode_fixtures import EOS, VOCAB, echo_prompts

from engine import LLM, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.verify_graphs import VerifyCudaGraphs, verify_buckets

K = 3
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "fallback_acceptance_rate": 0.0,
}
BASE = dict(
    skip_tokenizer_init=True,
    max_model_len=40,
    block_size=4,
    max_loras=2,
    max_lora_rank=8,
    attention_backend="triton",
    dtype="float32",
)
SETTINGS = {
    # 3 requests in buckets [1, 2, 4]: a padding lane; requests without proposals get ghost rows; a
    # budget of 16 tokens chunks the prompts (chunks of up to 4 tokens fit a lane).
    "mixed": dict(max_num_seqs=4, max_num_batched_tokens=16),
    # 12 blocks of 4 tokens for 3 requests of up to 30: requests are preempted, their rows rewritten.
    "preemption": dict(max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=12),
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """One layer (the interpreted kernels are slow); otherwise spec_decode_fixtures' echo case."""
    root = tmp_path_factory.mktemp("spec-lanes")
    model = make_model(
        root / "model", seed=1, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1, num_hidden_layers=1
    )
    adapters = {
        "qv": make_adapter(
            model, root / "qv", seed=11, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        ),
        "mlp": make_adapter(model, root / "mlp", seed=12, r=8, lora_alpha=8, target_modules=["down_proj"]),
    }
    return dict(model=model, adapters=adapters)


def _generate(case, setting: str, speculative_config=None):
    llm = LLM(
        str(case["model"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        speculative_config=speculative_config,
        **{**BASE, **SETTINGS[setting]},
    )
    runner = llm.engine.runner
    assert runner.verify_graphs is None  # the CPU captures nothing
    if speculative_config is not None:  # the graphs' forward, uncaptured: the lanes without CUDA
        runner.verify_graphs = VerifyCudaGraphs(runner, K)
    names = [*case["adapters"], None]
    params = [SamplingParams(temperature=0.0, max_tokens=14 + i, ignore_eos=True) for i in range(3)]
    outputs = llm.generate(echo_prompts(3), params, names)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm.engine


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_lanes_keep_greedy_tokens(case, setting):
    expected, _ = _generate(case, setting)
    got, engine = _generate(case, setting, NGRAM)
    assert got == expected
    assert engine.runner.verify_graphs.num_replays > 0
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    if setting == "preemption":
        assert engine.stats().num_preemptions > 0


def test_verify_buckets_are_bounded():
    assert verify_buckets(8, 4, 2048, None) == [1, 2, 4, 8]
    assert verify_buckets(64, 5, 2048, 8) == [1, 2, 4, 8]  # disable_by_batch_size: no larger steps speculate
    assert verify_buckets(64, 5, 64, None) == [1, 2, 4, 8, 12]  # 12 lanes of 5 fit a budget of 64
    assert verify_buckets(8, 17, 16, None) == []


def test_cuda_graphs_switch_is_validated():
    assert SpeculativeConfig.parse(NGRAM).cuda_graphs
    assert not SpeculativeConfig.parse({**NGRAM, "cuda_graphs": False}).cuda_graphs
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        SpeculativeConfig.parse({**NGRAM, "cuda_graphs": "no"})
