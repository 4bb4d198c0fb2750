"""The LoRA target set is the architecture's: Phi-3's fused qkv_proj / gate_up_proj, the seven separate
projections elsewhere. Each family's adapters pass, the other form is refused naming what fits, and the
full module paths PEFT saves for `target_modules="all-linear"` are read as the names they end in."""

from __future__ import annotations

import pytest

from adapter_format.checkpoint import check_adapter
from adapter_format.errors import AdapterError
from adapter_format.model_shape import TARGET_MODULES, ModelShape

PHI = ModelShape(2, 64, 128, 4, 2, 16, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), "Phi3ForCausalLM")
LLAMA = ModelShape(2, 64, 128, 4, 2, 16, TARGET_MODULES, "LlamaForCausalLM")


def tensors(shape: ModelShape, modules, rank: int = 4) -> dict[str, tuple[int, ...]]:
    out = {}
    for layer in range(shape.num_layers):
        for module in modules:
            fan_in, fan_out = ModelShape(2, 64, 128, 4, 2, 16, (module,)).module_dims(module)
            key = f"base_model.model.model.layers.{layer}.{shape.block(module)}.{module}"
            out[f"{key}.lora_A.weight"] = (rank, fan_in)
            out[f"{key}.lora_B.weight"] = (fan_out, rank)
    return out


def config(targets) -> dict:
    return {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": targets}


def test_fused_projections_have_the_sizes_of_their_parts():
    assert PHI.module_dims("qkv_proj") == (64, 64 + 2 * 32)
    assert PHI.module_dims("gate_up_proj") == (64, 256)
    with pytest.raises(ValueError, match="'q_proj' is not a LoRA target of Phi3ForCausalLM"):
        PHI.module_dims("q_proj")


def test_each_family_takes_its_own_adapters():
    phi = check_adapter(
        config(["qkv_proj", "gate_up_proj"]), tensors(PHI, ["qkv_proj", "gate_up_proj"]), PHI, 16
    )
    assert phi.target_modules == ("qkv_proj", "gate_up_proj") and phi.rank == 4
    llama = check_adapter(config(["q_proj", "v_proj"]), tensors(LLAMA, ["q_proj", "v_proj"]), LLAMA, 16)
    assert llama.target_modules == ("q_proj", "v_proj")


def test_all_linear_paths_are_read_by_their_last_name():
    paths = [f"model.layers.{i}.{PHI.block(m)}.{m}" for i in range(2) for m in PHI.targets]
    adapter = check_adapter(config(paths), tensors(PHI, PHI.targets), PHI, 16)
    assert adapter.target_modules == PHI.targets


@pytest.mark.parametrize(
    "shape, modules, message",
    [
        (PHI, ["q_proj", "v_proj"], "Phi3ForCausalLM stores q_proj, k_proj, v_proj fused as qkv_proj"),
        (PHI, ["gate_proj"], "stores gate_proj, up_proj fused as gate_up_proj"),
        (
            LLAMA,
            ["qkv_proj"],
            "LlamaForCausalLM has separate q_proj, k_proj, v_proj where this adapter targets",
        ),
        (
            LLAMA,
            ["score"],
            r"\['score'\] are not supported; LoRA on LlamaForCausalLM may target",
        ),
    ],
)
def test_the_other_form_is_refused_naming_what_fits(shape, modules, message):
    with pytest.raises(AdapterError, match=message) as err:
        check_adapter(config(modules), {}, shape, 16)
    assert err.value.code == "unsupported_target" and err.value.field == "target_modules"


def test_tensors_of_another_form_are_refused_even_under_a_regex_config():
    """A string target_modules is a regex PEFT matched at training: the tensors then decide."""
    with pytest.raises(AdapterError, match="targets 'q_proj'; LoRA on Phi3ForCausalLM may target") as err:
        check_adapter(config(".*proj"), tensors(PHI, ["q_proj"]), PHI, 16)
    assert err.value.code == "unsupported_target"
