"""The Megatron split, without processes: which rows each rank holds, the checkpoint read shard by shard,
and adapters cut as vLLM cuts them. Every rank's shards put back together must be the whole."""

from __future__ import annotations

import pytest
import torch
from factories import C1_ADAPTERS, make_adapter, make_model

from adapter_format.checkpoint import load_peft_adapter
from adapter_format.model_shape import ModelShape
from engine.lora.slots import SlotLayout, build_image
from engine.model import weight_source
from engine.model.loader import load_config, load_weights
from engine.parallel.lora_shards import shard_image
from engine.parallel.plan import COLUMN_PARALLEL, ShardPlan
from engine.parallel.sharded_loader import load_shard

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


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return make_model(
        tmp_path_factory.mktemp(f"shards-{request.param}") / "model", arch=request.param, seed=4
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_reassemble_the_checkpoint_and_are_read_by_slices(model_dir, world_size, monkeypatch):
    config = load_config(model_dir)
    whole = load_weights(model_dir, config, torch.float32, torch.device("cpu"))
    plan = ShardPlan(ModelShape.from_hf_config(config), config.vocab_size, world_size)
    opened = weight_source.safe_open

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

    monkeypatch.setattr(weight_source, "safe_open", slices_only)  # where the loaders open files
    shards = [
        load_shard(model_dir, config, plan, r, torch.float32, torch.device("cpu")) for r in range(world_size)
    ]
    torch.testing.assert_close(torch.cat([s.embed for s in shards]), whole.embed, rtol=0, atol=0)
    d, kv = plan.shape.head_dim, plan.kv_heads_per_rank * plan.shape.head_dim
    for i, layer in enumerate(whole.layers):
        q_size = plan.heads_per_rank * d
        q = torch.cat([s.layers[i].qkv[:q_size] for s in shards])
        assert torch.equal(q, layer.qkv[: plan.shape.num_heads * d])
        for r, s in enumerate(shards):  # k of rank r: its KV head's rows
            start = plan.kv_head_start(r) * d
            k_rows = layer.qkv[plan.shape.num_heads * d :][start : start + kv]
            assert torch.equal(s.layers[i].qkv[q_size : q_size + kv], k_rows)
            if layer.qkv_bias is not None:
                assert torch.equal(
                    s.layers[i].qkv_bias[q_size : q_size + kv],
                    layer.qkv_bias[plan.shape.num_heads * d :][start : start + kv],
                )
        assert torch.equal(torch.cat([s.layers[i].o for s in shards], dim=1), layer.o)
        assert torch.equal(torch.cat([s.layers[i].down for s in shards], dim=1), layer.down)
        gate = torch.cat([s.layers[i].gate_up[: plan.intermediate_per_rank] for s in shards])
        assert torch.equal(gate, layer.gate_up[: plan.shape.intermediate_size])
        assert all(torch.equal(s.layers[i].input_norm, layer.input_norm) for s in shards)


def test_adapter_shards_split_b_of_column_and_a_of_row_projections(tmp_path):
    model_dir = make_model(tmp_path / "model", seed=5)
    adapter_dir = make_adapter(model_dir, tmp_path / "adapter", seed=6, **C1_ADAPTERS["d_all"])
    plan = ShardPlan(C1_SHAPE, 512, 2)
    layout = SlotLayout(C1_SHAPE, 16)
    image = build_image(layout, torch.float32, load_peft_adapter(adapter_dir, C1_SHAPE, 16))
    local = SlotLayout(plan.local_shape, 16)
    shards = [shard_image(image, local, plan, r) for r in range(2)]
    for module in ("q_proj", "gate_proj", "o_proj", "down_proj"):
        if module in COLUMN_PARALLEL:
            assert all(torch.equal(s.lora_a[module], image.lora_a[module]) for s in shards)
            assert torch.equal(torch.cat([s.lora_b[module] for s in shards], dim=1), image.lora_b[module])
        else:
            assert all(torch.equal(s.lora_b[module], image.lora_b[module]) for s in shards)
            assert torch.equal(torch.cat([s.lora_a[module] for s in shards], dim=2), image.lora_a[module])
    assert all(torch.equal(s.table, image.table) for s in shards)
