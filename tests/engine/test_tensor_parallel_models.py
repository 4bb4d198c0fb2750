"""Tensor parallelism on the CPU (gloo) for the newer families and for FP8 weights: two ranks give the
greedy tokens of transformers + PEFT (Qwen3, Gemma 2/3, Phi-3 with mixed adapters, chunked prefill) and
of one rank (FP8: a block-scaled checkpoint with Phi-3's fused projections, a per-channel one, and
on-the-fly quantization, whose row-parallel scales are the maximum over the ranks as on one GPU); a
block-scaled checkpoint whose shards would cut a 128-column block is refused before any worker starts."""

from __future__ import annotations

import multiprocessing
import random
from contextlib import contextmanager

import pytest
import torch
from factories import load_peft_reference, make_adapter, make_model, reference_greedy
from fp8_checkpoints import write_block_fp8, write_compressed_tensors

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
ARGS = dict(
    max_lora_rank=16,
    max_loras=2,
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=8,  # chunked prefill
    block_size=4,
    max_model_len=64,
    async_scheduling=False,
)


@contextmanager
def engine(model_dir, **args):
    """An LLM whose workers are stopped however the test ends."""
    llm = LLM(model=str(model_dir), **{**ARGS, **args})
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def tp_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tp-worker")]


def generate(llm, prompts, adapters=None) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapters=adapters)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def random_prompts(seed: str, count: int = 4, low: int = 17, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(low, high))] for _ in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_two_ranks_match_peft(tmp_path, arch):
    model_dir = make_model(tmp_path / "model", arch=arch, seed=2)
    fused = arch == "phi3"
    adapters = {
        "qkv": make_adapter(
            model_dir,
            tmp_path / "qkv",
            seed=3,
            r=8,
            target_modules=["qkv_proj"] if fused else ["q_proj", "k_proj", "v_proj"],
        ),
        "all": make_adapter(
            model_dir, tmp_path / "all", seed=4, r=16, lora_alpha=32, target_modules="all-linear"
        ),
    }
    prompts = random_prompts(arch)
    assigned = ["qkv", None, "all", "qkv"]
    reference = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    lora_modules = {k: str(v) for k, v in adapters.items()}
    with engine(model_dir, tensor_parallel_size=2, lora_modules=lora_modules) as llm:
        assert llm.engine.runner.model.num_heads == 2  # this rank's half of the heads
        assert generate(llm, prompts, assigned) == expected
    assert tp_workers() == []


# Sizes whose row-parallel inputs split into whole 128-column blocks over 2 ranks (q 256 -> 128 each,
# intermediate 512 -> 256 each); Phi-3 stores q/k/v and gate/up fused, each fused tensor one scale grid.
BLOCK_SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-fp8")
    plain = make_model(root / "plain", seed=5)
    phi3 = make_model(root / "phi3", arch="phi3", seed=6, **BLOCK_SIZES)
    return {
        "plain": plain,
        "channel": write_compressed_tensors(plain, root / "channel", "channel", torch.float32),
        "block_phi3": write_block_fp8(phi3, root / "block_phi3"),
        # q 192 over 2 ranks: o_proj's shards would start at column 96, inside a block
        "block_cut": write_block_fp8(
            make_model(root / "cut", seed=7, hidden_size=192, intermediate_size=320), root / "block_cut"
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("model, quantization", [("block_phi3", None), ("channel", None), ("plain", "fp8")])
def test_fp8_weights_over_two_ranks_match_one(fp8_models, model, quantization):
    prompts = random_prompts(model, low=5, high=20)
    with engine(fp8_models[model], quantization=quantization) as llm:
        expected = generate(llm, prompts)
    with engine(fp8_models[model], quantization=quantization, tensor_parallel_size=2) as llm:
        kernel = llm.engine.runner.model.model.layers[0].mlp.down_proj.kernel
        assert kernel.weight.dtype == torch.float8_e4m3fn  # this rank's shard, in FP8
        assert generate(llm, prompts) == expected
    assert tp_workers() == []


def test_a_shard_boundary_inside_a_block_is_refused_before_workers_start(fp8_models):
    with pytest.raises(ValueError, match="cuts o_proj's 192 input columns into shards of 96, inside"):
        LLM(model=str(fp8_models["block_cut"]), tensor_parallel_size=2, **ARGS)
    assert tp_workers() == []
