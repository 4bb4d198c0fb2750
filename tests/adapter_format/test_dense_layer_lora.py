"""LoRA on a mixture of experts' dense layers (GLM-4.5's first `first_k_dense_replace` layers): their MLP's
gate_proj, up_proj and down_proj are targets at intermediate_size, on those layers only. An adapter trained
on transformers 4 with plain `target_modules=["q_proj", ..., "gate_proj", "up_proj", "down_proj"]` has them
beside per-expert and shared-expert pairs, and is served; a dense pair on an MoE layer, or an expert or
shared-expert pair on a dense layer, is refused naming the layer. Under tensor parallelism the dense MLP's
pairs split as a dense model's, with or without expert parallelism."""

from __future__ import annotations

import pytest
from test_shared_expert_lora import PREFIX, config, glm4_moe_shape, pair

from adapter_format.checkpoint import check_adapter
from adapter_format.errors import AdapterError
from engine.lora.slots import lora_launches
from engine.parallel.plan import ShardPlan

PLAIN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def transformers4_tensors(rank: int = 4) -> dict[str, tuple[int, ...]]:
    """Layer 0 dense (intermediate 128), layer 1 a mixture of experts (8 of 32, shared 2 x 32 = 64)."""
    shapes = pair(f"{PREFIX}.0.self_attn.q_proj", 64, 64, rank) | pair(
        f"{PREFIX}.1.self_attn.q_proj", 64, 64, rank
    )
    for part, (fan_in, fan_out) in (
        ("gate_proj", (64, 128)),
        ("up_proj", (64, 128)),
        ("down_proj", (128, 64)),
    ):
        shapes |= pair(f"{PREFIX}.0.mlp.{part}", fan_in, fan_out, rank)
    for part, (fan_in, fan_out) in (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64))):
        shapes |= pair(f"{PREFIX}.1.mlp.shared_experts.{part}", fan_in, fan_out, rank)
    for expert in range(8):
        for part, (fan_in, fan_out) in (
            ("gate_proj", (64, 32)),
            ("up_proj", (64, 32)),
            ("down_proj", (32, 64)),
        ):
            shapes |= pair(f"{PREFIX}.1.mlp.experts.{expert}.{part}", fan_in, fan_out, rank)
    return shapes


@pytest.mark.parametrize("targets", [PLAIN, "all-linear"])
def test_dense_layer_mlp_is_a_target_beside_experts_and_shared_experts(targets):
    shape = glm4_moe_shape(first_k_dense_replace=1)
    assert shape.dense_layers == (0,)
    assert shape.module_dims("gate_proj") == (64, 128) and shape.module_dims("down_proj") == (128, 64)
    adapter = check_adapter(config(targets), transformers4_tensors(), shape, 16)
    assert {(0, "gate_proj"), (0, "up_proj"), (0, "down_proj")} <= set(adapter.modules)
    assert {(1, "experts.gate_up_proj"), (1, "experts.down_proj"), (1, "shared_experts.up_proj")} <= set(
        adapter.modules
    )
    assert (0, "experts.gate_up_proj") not in adapter.modules
    launches = lora_launches(shape.targets)
    assert ("gate_proj", "up_proj") in launches and (
        "shared_experts.gate_proj",
        "shared_experts.up_proj",
    ) in launches
    # without a dense layer the dense MLP is no target, and a pair on it is refused naming the targets
    every_layer_moe = glm4_moe_shape()
    assert "gate_proj" not in every_layer_moe.targets
    with pytest.raises(AdapterError, match="targets 'gate_proj'"):
        check_adapter(config(PLAIN), transformers4_tensors(), every_layer_moe, 16)


@pytest.mark.parametrize(
    "name, fan_in, fan_out, message",
    [
        (
            f"{PREFIX}.1.mlp.gate_proj",
            64,
            128,
            "layer 1 .* is a mixture of experts, with no dense mlp.gate_proj .*layers 0",
        ),
        (
            f"{PREFIX}.0.mlp.shared_experts.down_proj",
            64,
            64,
            "layer 0 .* has a dense MLP .*not mlp.shared_experts",
        ),
        (f"{PREFIX}.0.mlp.experts.3.up_proj", 64, 32, "layer 0 expert 3 up_proj: layer 0 .* has a dense MLP"),
    ],
)
def test_pairs_on_the_wrong_kind_of_layer_are_refused(name, fan_in, fan_out, message):
    with pytest.raises(AdapterError, match=message) as raised:
        check_adapter(config(PLAIN), pair(name, fan_in, fan_out), glm4_moe_shape(first_k_dense_replace=1), 16)
    assert raised.value.code == "unsupported_target"


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_dense_mlp_splits_as_a_dense_models(expert_parallel):
    plan = ShardPlan(glm4_moe_shape(first_k_dense_replace=1), 512, 2, expert_parallel=expert_parallel)
    assert plan.local_shape.module_dims("gate_proj") == (64, 64)
    assert plan.output_range("up_proj", 1) == (64, 128)
    assert plan.input_range("down_proj", 1) == (64, 128)
