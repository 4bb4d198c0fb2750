"""DoRA adapters served in one batch with plain LoRA adapters and the base model: greedy tokens identical
to transformers + PEFT in float32 (Llama; Qwen2, whose q/k/v biases DoRA must leave unscaled; Phi-3's
fused projections), also
over 2 tensor-parallel ranks (gloo), where each row-parallel norm is summed over the ranks, and with
fewer slots than adapters (DoRA slots refilled by plain ones and back)."""

from __future__ import annotations

import random

import pytest
from factories import make_adapter, make_model
from formats_fixtures import greedy_by_adapter, make_dora_adapter

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 12


def adapters_for(arch: str) -> dict:
    """DoRA adapters of ranks 4 to 16 over attention, MLP and every projection, and a plain one; Phi-3's
    name its fused projections (PEFT's DoRA then has one magnitude over q, k and v's rows)."""
    fused = arch == "phi3"
    attention = ["qkv_proj"] if fused else ["q_proj", "v_proj"]
    mlp = ["gate_up_proj", "down_proj"] if fused else ["gate_proj", "down_proj"]
    plain = ["qkv_proj", "o_proj"] if fused else ["q_proj", "k_proj", "o_proj"]
    return {
        "dora_attn_r4": (make_dora_adapter, dict(r=4, lora_alpha=8, target_modules=attention)),
        "dora_all_r8": (
            make_dora_adapter,
            dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
        ),
        "dora_mlp_r16": (make_dora_adapter, dict(r=16, lora_alpha=8, target_modules=mlp)),
        "lora_r8": (make_adapter, dict(r=8, lora_alpha=16, target_modules=plain)),
    }


@pytest.fixture(scope="module", params=["llama", "qwen2", "phi3"])
def dora_case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"dora-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=3)
    adapters = {
        name: make(model_dir, root / name, seed=20 + i, **kwargs)
        for i, (name, (make, kwargs)) in enumerate(adapters_for(arch).items())
    }
    rng = random.Random(arch)
    names = [*adapters, None]
    # 17 tokens and up: past Phi-3 LongRoPE's original window from the start, as transformers needs to agree.
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(17, 31))] for _ in range(10)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    expected = greedy_by_adapter(model_dir, adapters, prompts, assigned, NUM_NEW_TOKENS)
    return dict(
        arch=arch,
        model_dir=model_dir,
        adapters=adapters,
        prompts=prompts,
        assigned=assigned,
        expected=expected,
    )


@pytest.mark.parametrize("max_num_batched_tokens", [1024, 8], ids=["one_batch", "chunked_prefill"])
def test_dora_mixed_with_lora_and_base_matches_peft(dora_case, max_num_batched_tokens):
    if max_num_batched_tokens == 8 and dora_case["arch"] != "llama":
        pytest.skip("chunked prefill is the same for every architecture: Llama's covers it")
    llm = LLM(
        model=str(dora_case["model_dir"]),
        lora_modules={k: str(v) for k, v in dora_case["adapters"].items()},
        max_loras=5,
        max_lora_rank=16,
        block_size=8,
        max_model_len=128,
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in dora_case["prompts"]], params, adapters=dora_case["assigned"]
    )
    for output, expected, adapter in zip(outputs, dora_case["expected"], dora_case["assigned"]):
        assert output.error is None
        assert output.outputs[0].token_ids == expected, f"adapter {adapter}"


@pytest.mark.slow
@pytest.mark.parametrize("tp, max_loras", [(2, 2)])
def test_dora_over_tensor_parallel_ranks_matches_peft(dora_case, tp, max_loras):
    if dora_case["arch"] == "qwen2":
        pytest.skip("CI time: Llama's split and Phi-3's fused projections cover the shards")
    llm = LLM(
        model=str(dora_case["model_dir"]),
        lora_modules={k: str(v) for k, v in dora_case["adapters"].items()},
        tensor_parallel_size=tp,
        max_loras=max_loras,
        max_lora_rank=16,
        block_size=8,
        max_model_len=128,
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=16,
    )
    workers = llm.engine.runner.parallel.workers.processes
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in dora_case["prompts"]], params, adapters=dora_case["assigned"]
        )
        assert [o.outputs[0].token_ids for o in outputs] == dora_case["expected"]
        assert llm.engine.lora.allocator.num_evictions > 0, "DoRA slots were meant to be refilled"
    finally:
        llm.engine.shutdown()
        assert not [p for p in workers if p.is_alive()], "a worker outlived the engine"
