"""Uploads are checked against the served architecture's LoRA targets: a Phi-3 store takes PEFT's
qkv_proj / gate_up_proj adapters (also saved by `target_modules="all-linear"`) and refuses a Llama-style
q_proj adapter, naming the fused form; a Llama store refuses a Phi-3 adapter. Nothing is written."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Phi3Config, Phi3ForCausalLM

from adapters_store import AdapterFiles, CountingMetrics, InvalidAdapter, StoreConfig, open_store
from engine import model_shape

TINY_PHI = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    intermediate_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def phi_adapters(tmp_path_factory):
    torch.manual_seed(0)
    base = Phi3ForCausalLM(Phi3Config(**TINY_PHI))
    folders = {}
    for name, targets in (("fused", ["qkv_proj", "gate_up_proj"]), ("all_linear", "all-linear")):
        folder = tmp_path_factory.mktemp(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(base, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
            model.save_pretrained(folder)
            base = model.unload()
        folders[name] = folder
    return folders


def files(folder) -> AdapterFiles:
    return AdapterFiles(config=folder / "adapter_config.json", weights=folder / "adapter_model.safetensors")


@pytest.fixture
def phi_store(tmp_path, fast_retries):
    shape = model_shape(Phi3Config(**TINY_PHI, architectures=["Phi3ForCausalLM"]))
    config = StoreConfig(
        url=f"file://{tmp_path / 'store'}", staging_dir=str(tmp_path / "staging"), **fast_retries
    )
    return open_store(config, shape, CountingMetrics())


def test_a_phi3_store_takes_fused_and_all_linear_adapters(phi_store, phi_adapters):
    record = phi_store.put("acme", "fused", files(phi_adapters["fused"]))
    assert record.target_modules == ("qkv_proj", "gate_up_proj")
    record = phi_store.put("acme", "every", files(phi_adapters["all_linear"]))
    assert record.target_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_a_phi3_store_refuses_a_llama_style_adapter(phi_store, keys_of, make_peft_adapter):
    with pytest.raises(InvalidAdapter, match="stores q_proj, k_proj, v_proj fused as qkv_proj") as err:
        phi_store.put("acme", "llama-style", files(make_peft_adapter(target_modules=("q_proj", "v_proj"))))
    assert err.value.code == "unsupported_target"
    assert keys_of(phi_store) == []


@pytest.mark.parametrize("backend", ["local"])
def test_a_llama_store_refuses_a_phi3_adapter(store, keys_of, phi_adapters):
    with pytest.raises(
        InvalidAdapter, match="has separate q_proj, k_proj, v_proj where this adapter targets"
    ):
        store.put("acme", "phi", files(phi_adapters["fused"]))
    assert keys_of(store) == []
