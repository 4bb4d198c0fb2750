"""The Megatron split, without processes: which rows each rank holds, the checkpoint read shard by shard,
and adapters cut as vLLM cuts them. Every rank's shards put back together must be the whole."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from factories import C1_ADAPTERS, make_adapter, make_model

from adapter_format.checkpoint import load_peft_adapter
from adapter_format.model_shape import ModelShape
from engine.lora.slots import SlotLayout, build_image
from engine.model import loader
from engine.model.layers.sharding import TensorParallel
from engine.model.loader import load_config, load_model
from engine.parallel.lora_shards import shard_image
from engine.parallel.plan import COLUMN_PARALLEL, ShardPlan

C1_SHAPE = ModelShape(
    num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.mark.parametrize(
    "world_size, rank, q, kv, mlp, vocab",
    [
        (2, 0, (0, 32), (0, 16), (0, 64), (0, 256)),
        (2, 1, (32, 64), (16, 32), (64, 128), (256, 512)),
        # 2 KV heads over 4 ranks: ranks 0, 1 share KV head 0; ranks 2, 3 KV head 1 (their q heads' group)
        (4, 1, (16, 32), (0, 16), (32, 64), (128, 256)),
        (4, 2, (32, 48), (16, 32), (64, 96), (256, 384)),
    ],
)
def test_plan_ranges(world_size, rank, q, kv, mlp, vocab):
    plan = ShardPlan(C1_SHAPE, 512, world_size)
    assert plan.output_range("q_proj", rank) == q
    assert plan.output_range("k_proj", rank) == plan.output_range("v_proj", rank) == kv
    assert plan.output_range("gate_proj", rank) == plan.output_range("up_proj", rank) == mlp
    assert plan.input_range("o_proj", rank) == q
    assert plan.input_range("down_proj", rank) == mlp
    assert plan.vocab_range(rank) == vocab


def test_vocabulary_the_ranks_do_not_divide_is_padded():
    plan = ShardPlan(C1_SHAPE, 510, 4)
    assert plan.vocab_per_rank == 128
    assert plan.vocab_range(3) == (384, 510)


@pytest.mark.parametrize(
    "shape, world_size, message",
    [
        (C1_SHAPE, 3, "does not divide the model's 4 attention heads"),
        (ModelShape(2, 96, 128, 6, 3, 16), 2, "KV heads"),
        (ModelShape(2, 64, 90, 8, 8, 8), 4, "intermediate_size 90"),
    ],
)
def test_splits_that_do_not_divide_are_refused(shape, world_size, message):
    with pytest.raises(ValueError, match=message):
        ShardPlan(shape, 512, world_size)


@pytest.fixture(scope="module", params=["llama", "qwen2", "phi3"])
def model_dir(request, tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp(f"shards-{request.param}") / "model", arch=request.param, seed=4
    )


def load_rank(model_dir, config, rank: int, world_size: int):
    """One rank's model as its worker builds it (no process group: loading needs none)."""
    tp = TensorParallel(rank, world_size)
    return load_model(model_dir, config, torch.float32, torch.device("cpu"), tp=tp)


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_reassemble_the_checkpoint_and_are_read_by_slices(model_dir, world_size, monkeypatch):
    config = load_config(model_dir)
    whole = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    plan = ShardPlan.for_model(config, world_size)
    opened = loader.safe_open

    def slices_only(*args, **kwargs):  # a handle whose get_tensor (a whole read) fails the test
        handle = opened(*args, **kwargs)

        class Sliced:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            keys = handle.keys
            get_slice = handle.get_slice

        return Sliced()

    monkeypatch.setattr(loader, "safe_open", slices_only)
    shards = [load_rank(model_dir, config, r, world_size) for r in range(world_size)]
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])
    torch.testing.assert_close(embed, whole.model.embed_tokens.weight, rtol=0, atol=0)
    d, kv = plan.shape.head_dim, plan.kv_heads_per_rank * plan.shape.head_dim
    q_size = plan.heads_per_rank * d
    for i, layer in enumerate(whole.model.layers):
        parts = [s.model.layers[i] for s in shards]
        qkv = layer.self_attn.qkv_proj
        q = torch.cat([p.self_attn.qkv_proj.weight[:q_size] for p in parts])
        assert torch.equal(q, qkv.weight[: plan.shape.num_heads * d])
        for r, p in enumerate(parts):  # k of rank r: its KV head's rows
            start = plan.kv_head_start(r) * d
            k_rows = qkv.weight[plan.shape.num_heads * d :][start : start + kv]
            assert torch.equal(p.self_attn.qkv_proj.weight[q_size : q_size + kv], k_rows)
            if qkv.bias is not None:
                assert torch.equal(
                    p.self_attn.qkv_proj.bias[q_size : q_size + kv],
                    qkv.bias[plan.shape.num_heads * d :][start : start + kv],
                )
        o = torch.cat([p.self_attn.o_proj.weight for p in parts], dim=1)
        assert torch.equal(o, layer.self_attn.o_proj.weight)
        down = torch.cat([p.mlp.down_proj.weight for p in parts], dim=1)
        assert torch.equal(down, layer.mlp.down_proj.weight)
        gate = torch.cat([p.mlp.gate_up_proj.weight[: plan.intermediate_per_rank] for p in parts])
        assert torch.equal(gate, layer.mlp.gate_up_proj.weight[: plan.shape.intermediate_size])
        up = torch.cat([p.mlp.gate_up_proj.weight[plan.intermediate_per_rank :] for p in parts])
        assert torch.equal(up, layer.mlp.gate_up_proj.weight[plan.shape.intermediate_size :])
        assert all(torch.equal(p.input_layernorm.weight, layer.input_layernorm.weight) for p in parts)


@pytest.mark.parametrize(
    "arch, target_modules",
    [
        ("llama", C1_ADAPTERS["d_all"]["target_modules"]),
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ],
)
def test_adapter_shards_split_b_of_column_and_a_of_row_projections(tmp_path, arch, target_modules):
    model_dir = make_model(tmp_path / "model", arch=arch, seed=5)
    adapter_dir = make_adapter(model_dir, tmp_path / "adapter", seed=6, r=16, target_modules=target_modules)
    plan = ShardPlan.for_model(load_config(model_dir), 2)
    shape = plan.shape
    layout = SlotLayout(shape, 16)
    image = build_image(layout, torch.float32, load_peft_adapter(adapter_dir, shape, 16))
    local = SlotLayout(plan.local_shape, 16)
    shards = [shard_image(image, local, plan, r) for r in range(2)]
    for module in shape.targets:
        if module in COLUMN_PARALLEL:
            assert all(torch.equal(s.lora_a[module], image.lora_a[module]) for s in shards)
            rows = [torch.arange(a, b) for r in range(2) for a, b in plan.output_ranges(module, r)]
            whole_b = image.lora_b[module][:, torch.cat(rows)]  # every rank's rows, in rank order
            assert torch.equal(torch.cat([s.lora_b[module] for s in shards], dim=1), whole_b)
        else:
            assert all(torch.equal(s.lora_b[module], image.lora_b[module]) for s in shards)
            assert torch.equal(torch.cat([s.lora_a[module] for s in shards], dim=2), image.lora_a[module])
    assert all(torch.equal(s.table, image.table) for s in shards)


def test_a_fused_qkv_target_keeps_each_parts_rows():
    """Phi-3's qkv_proj over 2 ranks: rank 1 holds q rows [32, 64), then k rows [16, 32) and v rows
    [16, 32) of their parts (offsets 64 and 96 in the fused output)."""
    plan = ShardPlan(replace(C1_SHAPE, targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")), 512, 2)
    assert plan.output_ranges("qkv_proj", 1) == [(32, 64), (80, 96), (112, 128)]
    assert plan.output_ranges("gate_up_proj", 0) == [(0, 64), (128, 192)]
