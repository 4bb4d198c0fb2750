"""LoRA on a shared expert (Qwen2-MoE's `mlp.shared_expert`): its projections are targets of their own, at
the shared expert's size, beside attention and the routed experts; the router (`mlp.gate`) and the shared
expert's gate (`mlp.shared_expert_gate`, which PEFT's all-linear wraps) are refused naming them; under
tensor parallelism the shared expert's pairs split as a dense MLP's. GLM-4.5's `mlp.shared_experts` likewise, by that name."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adapter_format.checkpoint import check_adapter
from adapter_format.errors import AdapterError
from adapter_format.model_shape import (
    EXPERT_MODULES,
    SHARED_EXPERT_MODULES,
    SHARED_EXPERTS_MODULES,
    ModelShape,
)
from engine.lora.slots import lora_launches
from engine.parallel.plan import ShardPlan

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
QWEN2_MOE = ModelShape(
    2, 64, 128, 4, 2, 16, (*ATTENTION, *EXPERT_MODULES, *SHARED_EXPERT_MODULES), "Qwen2MoeForCausalLM", 8, 32,
    shared_expert_intermediate_size=48,
)  # fmt: skip
PREFIX = "base_model.model.model.layers"


def pair(name: str, fan_in: int, fan_out: int, rank: int = 4) -> dict[str, tuple[int, ...]]:
    return {f"{name}.lora_A.weight": (rank, fan_in), f"{name}.lora_B.weight": (fan_out, rank)}


def shared_expert_tensors(rank: int = 4) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for layer in (0, 1):
        for part, (fan_in, fan_out) in (
            ("gate_proj", (64, 48)),
            ("up_proj", (64, 48)),
            ("down_proj", (48, 64)),
        ):
            shapes |= pair(f"{PREFIX}.{layer}.mlp.shared_expert.{part}", fan_in, fan_out, rank)
    return shapes


def config(targets, **extra) -> dict:
    return {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": targets, **extra}


def test_shared_expert_projections_are_targets_of_their_own_size():
    assert QWEN2_MOE.module_dims("shared_expert.gate_proj") == (64, 48)
    assert QWEN2_MOE.module_dims("shared_expert.down_proj") == (48, 64)
    targets = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]
    adapter = check_adapter(config(targets), shared_expert_tensors(), QWEN2_MOE, 16)
    assert adapter.target_modules == SHARED_EXPERT_MODULES
    assert adapter.modules[(1, "shared_expert.up_proj")].scale == 2.0
    # plain gate_proj names the shared expert's too, as PEFT matches names by their ends
    plain = check_adapter(
        config(["gate_proj", "up_proj", "down_proj"]), shared_expert_tensors(), QWEN2_MOE, 16
    )
    assert plain.target_modules == SHARED_EXPERT_MODULES
    # gate and up run as one launch, as a dense MLP's do
    assert ("shared_expert.gate_proj", "shared_expert.up_proj") in lora_launches(QWEN2_MOE.targets)


# target_modules as PEFT 0.21 saves "all-linear" on Qwen2-MoE: short names, the shared expert's gate among them.
ALL_LINEAR_SAVED = [
    "gate_proj",
    "down_proj",
    "v_proj",
    "k_proj",
    "o_proj",
    "shared_expert_gate",
    "up_proj",
    "q_proj",
]


@pytest.mark.parametrize("listed", [False, True])  # "all-linear", or the list PEFT saves for it
@pytest.mark.parametrize("gate, fan_out", [("shared_expert_gate", 1), ("gate", 8)])
def test_lora_on_the_gates_is_refused_naming_them(gate, fan_out, listed):
    tensors = {**shared_expert_tensors(), **pair(f"{PREFIX}.0.mlp.{gate}", 64, fan_out)}
    targets = sorted({*ALL_LINEAR_SAVED, gate}) if listed else "all-linear"
    with pytest.raises(AdapterError, match=rf"'{gate}'.*mlp\.{gate} weighs or picks the experts") as error:
        check_adapter(config(targets), tensors, QWEN2_MOE, 16)
    assert error.value.code == "unsupported_target"


def test_all_linear_with_the_gate_excluded_is_served():
    """What the refusal advises: PEFT still lists shared_expert_gate in target_modules, but wraps it not."""
    settings = config(ALL_LINEAR_SAVED, exclude_modules=["shared_expert_gate"])
    adapter = check_adapter(settings, shared_expert_tensors(), QWEN2_MOE, 16)
    assert adapter.target_modules == SHARED_EXPERT_MODULES


def test_a_model_without_a_shared_expert_refuses_its_tensors():
    qwen3_moe = ModelShape(2, 64, 128, 4, 2, 16, (*ATTENTION, *EXPERT_MODULES), "Qwen3MoeForCausalLM", 8, 32)
    with pytest.raises(AdapterError, match="targets 'shared_expert.gate_proj'") as error:
        check_adapter(config(["gate_proj"]), shared_expert_tensors(), qwen3_moe, 16)
    assert error.value.code == "unsupported_target"


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_the_shared_expert_splits_as_a_dense_mlp(expert_parallel):
    plan = ShardPlan(QWEN2_MOE, 512, 2, expert_parallel)
    assert plan.local_shape.module_dims("shared_expert.gate_proj") == (64, 24)
    assert plan.local_shape.module_dims("shared_expert.down_proj") == (24, 64)
    assert plan.output_ranges("shared_expert.up_proj", 1) == [(24, 48)]
    assert plan.input_range("shared_expert.down_proj", 1) == (24, 48)
    with pytest.raises(ValueError, match="shared expert's intermediate size 50"):
        ShardPlan(replace(QWEN2_MOE, shared_expert_intermediate_size=50), 512, 4, expert_parallel)


# GLM-4.5's shared experts: `mlp.shared_experts` (plural), n_shared_experts of moe_intermediate_size run
# as one MLP (2 x 32 here), sized from the config; every layer a mixture of experts (a dense first layer:
# tests/adapter_format/test_dense_layer_lora.py).
def glm4_moe_shape(first_k_dense_replace: int = 0) -> ModelShape:
    from transformers import Glm4MoeConfig

    from engine.model.registry import model_shape

    return model_shape(
        Glm4MoeConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, n_routed_experts=8, moe_intermediate_size=32,
            n_shared_experts=2, architectures=["Glm4MoeForCausalLM"], num_experts_per_tok=2,
            first_k_dense_replace=first_k_dense_replace,
        )
    )  # fmt: skip


def test_glm_shared_experts_are_targets_of_their_own_name_and_size():
    shape = glm4_moe_shape()
    assert shape.targets[-3:] == SHARED_EXPERTS_MODULES and shape.shared_expert_intermediate_size == 64
    assert shape.module_dims("shared_experts.gate_proj") == (64, 64)
    tensors = {
        name.replace(".shared_expert.", ".shared_experts."): value
        for name, value in shared_expert_tensors().items()
    }
    tensors = {k: tuple(64 if d == 48 else d for d in v) for k, v in tensors.items()}
    adapter = check_adapter(config(["shared_experts.gate_proj", "up_proj", "down_proj"]), tensors, shape, 16)
    assert adapter.target_modules == SHARED_EXPERTS_MODULES
    assert ("shared_experts.gate_proj", "shared_experts.up_proj") in lora_launches(shape.targets)
    with pytest.raises(AdapterError, match="targets 'shared_expert.gate_proj'"):  # Qwen2-MoE's spelling
        check_adapter(config(["gate_proj"]), shared_expert_tensors(), shape, 16)
    plan = ShardPlan(shape, 512, 2, expert_parallel=True)
    assert plan.local_shape.module_dims("shared_experts.down_proj") == (32, 64)
    assert plan.output_ranges("shared_experts.up_proj", 1) == [(32, 64)]
    assert plan.input_range("shared_experts.down_proj", 1) == (32, 64)
