"""Mixtures of experts over two ranks on the CPU (gloo): tensor parallelism (every rank a slice of every
expert) and expert parallelism (`enable_expert_parallel`: whole experts per rank), attention
tensor-parallel in both, give the greedy tokens of transformers + PEFT with adapters on attention and on
the routed experts (Qwen2-MoE, GLM-4.5: and on the shared expert, split as a dense MLP either way) mixed with
base-model requests; the workers are gone afterwards."""

from __future__ import annotations

import multiprocessing
import random

import pytest
from factories import make_adapter, make_model, moe_adapters, per_adapter_reference
from test_moe_models import expected_tokens

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
ARGS = dict(
    max_lora_rank=16,
    max_loras=3,
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=8,  # chunked prefill
    block_size=4,
    max_model_len=64,
    async_scheduling=False,
    tensor_parallel_size=2,
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, expert_parallel",
    [
        ("qwen3_moe", False),
        ("mixtral", True),
        ("qwen2_moe", False),
        ("qwen2_moe", True),
        ("olmoe", False),
        ("glm4_moe", False),
        ("glm4_moe", True),
        ("gpt_oss", False),
        ("gpt_oss", True),
    ],
)
def test_two_ranks_match_peft(tmp_path, arch, expert_parallel):
    model_dir = make_model(tmp_path / "model", arch=arch, seed=3)
    adapters = {
        name: make_adapter(model_dir, tmp_path / name, seed=30 + i, **kwargs)
        for i, (name, kwargs) in enumerate(moe_adapters(arch).items())
    }
    rng = random.Random(arch)
    assigned = ["experts_r8", None, "both_r16", "attn_r4"]
    assigned += [name for name in adapters if name not in assigned]  # Qwen2-MoE's shared expert's
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(9, 16))] for _ in assigned]
    references = per_adapter_reference(model_dir, adapters)
    expected = [expected_tokens(references[a], p, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    lora_modules = {k: str(v) for k, v in adapters.items()}
    llm = LLM(model=str(model_dir), lora_modules=lora_modules, enable_expert_parallel=expert_parallel, **ARGS)
    try:
        experts = llm.engine.runner.model.moe_layers[0].experts
        assert experts.num_local == (4 if expert_parallel else 8)  # rank 0's experts
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapters=assigned)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.engine.shutdown()
    assert [p for p in multiprocessing.active_children() if p.name.startswith("tp-worker")] == []


def test_expert_parallel_needs_experts_that_split(tmp_path):
    model_dir = make_model(tmp_path / "model", arch="mixtral", seed=3, num_local_experts=3)
    with pytest.raises(ValueError, match="needs the model's 3 experts to split evenly"):
        LLM(model=str(model_dir), enable_expert_parallel=True, **ARGS)
