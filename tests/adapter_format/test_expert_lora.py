"""LoRA on a mixture of experts' stacked expert weights (PEFT's target_parameters): PEFT's nested
wrappers are read by their shapes, each expert's pair is PEFT's own (the update equals PEFT's
get_delta_weight), what PEFT would not apply or cannot load is refused naming why, a dense model still
refuses target_parameters, and the pool takes pages by the adapter's rank."""

from __future__ import annotations

import pytest
import torch

from adapter_format.checkpoint import check_adapter
from adapter_format.errors import AdapterError
from adapter_format.expert_lora import expert_pair
from adapter_format.model_shape import ModelShape
from engine.lora.slots import PAGE_RANK, SlotLayout, build_image

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
MOE = ModelShape(2, 64, 128, 4, 2, 16, (*ATTENTION, *EXPERTS), "Qwen3MoeForCausalLM", 8, 32)
PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def expert_tensors(rank: int = 4, layers=(0, 1), gate_up_nested: bool = True) -> dict[str, tuple[int, ...]]:
    """PEFT's names: the inner wrapper (`base_layer`) adapts one parameter, the outer one the other."""
    e, h, i = 8, 64, 32
    inner, outer = ((h, 2 * i), (i, h)) if gate_up_nested else ((i, h), (h, 2 * i))
    shapes = {}
    for layer in layers:
        for nest, (cols, out) in ((".base_layer", inner), ("", outer)):
            prefix = f"base_model.model.model.layers.{layer}.mlp.experts{nest}"
            shapes[f"{prefix}.lora_A.weight"] = (e * rank, cols)
            shapes[f"{prefix}.lora_B.weight"] = (out, e * rank)
    return shapes


def config(**extra) -> dict:
    return {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": [],
        "target_parameters": PARAMS,
        **extra,
    }


@pytest.mark.parametrize("gate_up_nested", [True, False])
def test_the_nesting_order_does_not_matter(gate_up_nested):
    adapter = check_adapter(config(), expert_tensors(gate_up_nested=gate_up_nested), MOE, 16)
    assert adapter.target_modules == EXPERTS
    assert set(adapter.modules) == {(layer, m) for layer in (0, 1) for m in EXPERTS}
    assert adapter.modules[(0, "experts.gate_up_proj")].rank == 4
    assert adapter.modules[(0, "experts.gate_up_proj")].scale == 2.0


@pytest.mark.parametrize(
    "cfg, tensors, code, words",
    [
        (config(target_parameters=["mlp.experts.gate_up_proj"]), expert_tensors(), "tensor_not_targeted", "target_parameters does not name it"),
        (config(target_parameters=["mlp.experts.w9"]), expert_tensors(), "unsupported_target", "mlp.experts.gate_up_proj"),
        (config(), {**expert_tensors(), "base_model.model.model.layers.0.mlp.experts.lora_B.weight": (63, 32)}, "shape_mismatch", "fit no stacked expert weight"),
        (config(r=32), expert_tensors(rank=32), "rank_too_large", "max_lora_rank 16"),
        (config(r=8), expert_tensors(rank=4), "rank_mismatch", "rank 8"),
        (config(target_parameters="mlp.experts.gate_up_proj"), expert_tensors(), "bad_config", "must be a list"),
    ],
)  # fmt: skip
def test_what_peft_would_not_apply_is_refused(cfg, tensors, code, words):
    with pytest.raises(AdapterError, match=words) as error:
        check_adapter(cfg, tensors, MOE, 16)
    assert error.value.code == code


def test_a_dense_model_still_refuses_target_parameters():
    dense = ModelShape(2, 64, 128, 4, 2, 16)
    with pytest.raises(AdapterError, match="target_parameters is set") as error:
        check_adapter(config(), expert_tensors(), dense, 16)
    assert error.value.code == "feature_unsupported"


def test_expert_pairs_are_peft_updates():
    """B_e @ A_e * scaling of expert_pair's layout equals PEFT's get_delta_weight for every expert."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    hf = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
    )  # fmt: skip
    model = get_peft_model(
        AutoModelForCausalLM.from_config(hf),
        LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=PARAMS, init_lora_weights=False),
    )
    wrapper = model.base_model.model.model.layers[0].mlp.experts
    while True:  # the nested ParamWrappers, outermost first
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        a_e, b_e = expert_pair(a, b, 8)
        delta = torch.einsum("eor,eri->eoi", b_e, a_e) * wrapper.scaling["default"]
        torch.testing.assert_close(delta, wrapper.get_delta_weight("default"))
        if not hasattr(wrapper.base_layer, "lora_A"):
            break
        wrapper = wrapper.base_layer


def test_pool_pages_follow_the_adapters_rank():
    layout = SlotLayout(MOE, 16)
    blocks = layout.blocks()
    assert blocks["experts.gate_up_proj", "a"][1] == (2, 8, PAGE_RANK, 64)  # per layer, expert, page rank
    assert blocks["experts.down_proj", "b"][1] == (2, 8, 64, PAGE_RANK)
    for rank, pages in ((4, 1), (8, 1), (16, 2)):
        shapes = expert_tensors(rank=rank)
        adapter = check_adapter(config(r=rank), shapes, MOE, 16)
        tensors = {
            key: type(m)(m.rank, m.scale, torch.randn(8, m.rank, MOE.module_dims(key[1])[0]),
                         torch.randn(8, MOE.module_dims(key[1])[1], m.rank))
            for key, m in adapter.modules.items()
        }  # fmt: skip
        adapter = type(adapter)(adapter.rank, adapter.alpha, adapter.target_modules, None, tensors)
        image = build_image(layout, torch.float32, adapter)
        assert image.num_pages == pages
        pair = tensors[(1, "experts.down_proj")]
        a = image.page_a["experts.down_proj"][1]  # [max_pages, E, PAGE_RANK, in]
        b = image.page_b["experts.down_proj"][1]  # [max_pages, E, out, PAGE_RANK]
        torch.testing.assert_close(a.transpose(0, 1).flatten(1, 2)[:, :rank], pair.lora_a)
        torch.testing.assert_close(b.permute(1, 2, 0, 3).flatten(2)[:, :, :rank], pair.lora_b)


def per_expert_tensors(
    rank: int = 4, parts=("gate_proj", "up_proj", "down_proj")
) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for expert in (0, 3):
        for part in parts:
            cols, out = (32, 64) if part == "down_proj" else (64, 32)
            prefix = f"base_model.model.model.layers.1.mlp.experts.{expert}.{part}"
            shapes[f"{prefix}.lora_A.weight"], shapes[f"{prefix}.lora_B.weight"] = (rank, cols), (out, rank)
    return shapes


def test_per_expert_pairs_fold_gate_and_up():
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
    }
    adapter = check_adapter(cfg, per_expert_tensors(), MOE, 16)
    assert adapter.modules[(1, "experts.gate_up_proj")].rank == 8  # gate's 4 + up's 4
    assert adapter.modules[(1, "experts.down_proj")].rank == 4
    with pytest.raises(AdapterError, match="fold into one experts.gate_up_proj pair of rank 16") as error:
        check_adapter({**cfg, "r": 8}, per_expert_tensors(rank=8), MOE, 8)
    assert error.value.code == "rank_too_large"
    with pytest.raises(AdapterError, match="target_modules does not name it") as error:
        check_adapter({**cfg, "target_modules": ["gate_proj", "down_proj"]}, per_expert_tensors(), MOE, 16)
    assert error.value.code == "tensor_not_targeted"
