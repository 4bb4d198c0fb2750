"""Rank-aware steps: a step's LoRA kernels are sized to the rank buckets of the adapters it uses, not to
max_lora_rank, and the engine's tokens stay those of transformers + PEFT.

The kernels' windows themselves are checked against float64 in tests/lora_kernels/test_lora_paged.py
(interpreted) and test_lora_paged_gpu.py; the GPU engine with decode graphs keyed by the buckets in
test_rank_buckets_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import load_peft_reference, make_adapter, make_model, reference_greedy

import engine.model_runner
from adapter_format.checkpoint import ModuleLoRA, PeftAdapter
from adapter_format.model_shape import ModelShape
from engine import LLM, SamplingParams
from engine.lora.context import LoRAContext
from engine.lora.pool import LoRAPool, kernel_rank_buckets

SHAPE = ModelShape(
    num_layers=2, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8
)
NUM_NEW_TOKENS = 6


def adapter(ranks: dict[tuple[int, str], int]) -> PeftAdapter:
    modules = {}
    for (layer, module), rank in ranks.items():
        fan_in, fan_out = SHAPE.module_dims(module)
        modules[layer, module] = ModuleLoRA(rank, 1.0, torch.ones(rank, fan_in), torch.ones(fan_out, rank))
    return PeftAdapter(max(ranks.values()), 8.0, tuple(sorted({m for _, m in ranks})), None, modules)


@pytest.mark.parametrize(
    "kernel_rank, buckets",
    [(8, (8,)), (16, (16,)), (24, (16, 24)), (64, (16, 64)), (128, (16, 64, 128)), (256, (16, 64, 256))],
)
def test_buckets_grow_by_four_from_sixteen_to_the_kernel_rank(kernel_rank, buckets):
    assert kernel_rank_buckets(kernel_rank) == buckets


def test_a_step_is_sized_to_the_buckets_its_slots_use():
    pool = LoRAPool(SHAPE, max_loras=4, max_rank=64, dtype=torch.float32, device=torch.device("cpu"))
    assert pool.rank_buckets == (16, 64) and pool.bucket_variants() == [(16,), (64,), (16, 64)]
    small = adapter({(0, "q_proj"): 8, (1, "down_proj"): 16})
    large = adapter({(0, "v_proj"): 64, (1, "up_proj"): 48})
    both = adapter({(0, "q_proj"): 4, (1, "o_proj"): 64})  # rank 4 in one layer, 64 in another
    for slot, made in enumerate((small, large, both)):
        image = pool.image(made)
        pool.load(slot, image, list(range(slot * 8, slot * 8 + image.num_pages)))
    assert list(pool.slot_buckets[:3]) == [0b01, 0b10, 0b11]
    assert pool.step_buckets(np.array([0])) == (16,)  # rank-16 kernels, not rank-64 ones
    assert pool.step_buckets(np.array([1])) == (64,)
    assert pool.step_buckets(np.array([0, 1])) == (16, 64)  # one launch pair each
    assert pool.step_buckets(np.array([2])) == (16, 64)  # its own layers need both
    assert pool.step_buckets(np.array([], dtype=np.int64)) == (16, 64)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("rank-buckets")
    model_dir = make_model(root / "model", seed=11)
    adapters = {
        "small": make_adapter(
            model_dir, root / "small", seed=12, r=8, target_modules=["q_proj", "down_proj"]
        ),
        "large": make_adapter(model_dir, root / "large", seed=13, r=64, target_modules=["v_proj", "up_proj"]),
    }
    return model_dir, adapters


def test_the_engine_sizes_each_step_and_matches_peft(mixed, monkeypatch):
    """Steps with only the rank-8 adapter run kernels for rank 16; steps with both, a pair per bucket.
    On the CPU the kernels are the torch reference, which checks every token's rank fits the buckets
    the runner chose (lora_kernels.checks.check_bucket_ranks): a bucket too small fails the step."""
    model_dir, adapters = mixed
    chosen: list[tuple[int, ...] | None] = []

    class Recording(LoRAContext):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            chosen.append(self.rank_buckets)

    monkeypatch.setattr(engine.model_runner, "LoRAContext", Recording)
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        lora_modules={k: str(v) for k, v in adapters.items()},
        max_loras=2,
        max_lora_rank=64,
        max_model_len=64,
        block_size=8,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    prompts = [[5, 9, 23, 7], [40, 2, 11, 3, 8]]
    small_only = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=["small", None])
    assert set(chosen) == {(16,)}
    chosen.clear()
    both = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=["small", "large"])
    assert (16, 64) in chosen and set(chosen) <= {(16,), (64,), (16, 64)}  # alone at the ends: one bucket
    reference = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, ["small", None])]
    assert [o.outputs[0].token_ids for o in small_only] == expected
    expected = [
        reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, ["small", "large"])
    ]
    assert [o.outputs[0].token_ids for o in both] == expected
