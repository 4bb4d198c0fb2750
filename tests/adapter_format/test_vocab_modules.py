"""An adapter's own embed_tokens / lm_head (modules_to_save, LoRA on them, saved base layers), read from
adapters PEFT saves at test time: the matrices and products equal what PEFT's layers compute, tied
embeddings follow PEFT, and what cannot be served is refused naming the field."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from adapter_format.checkpoint import check_adapter, load_peft_adapter, map_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.model_shape import ModelShape
from adapter_format.vocab_modules import ties_head_to_embedding

WEIGHTS = "adapter_model.safetensors"
TINY = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=96,
)


def make(tmp_path, tied=False, resize=0, **lora):
    """(PEFT model, its saved folder, the base model's shape) for a tiny random Llama."""
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, tie_word_embeddings=tied)
    base = LlamaForCausalLM(config)
    shape = ModelShape.from_hf_config(config)
    if resize:
        base.resize_token_embeddings(TINY["vocab_size"] + resize)
    lora.setdefault("target_modules", ["q_proj"])
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora))
    with torch.no_grad():  # modules_to_save copies start equal to the base: make them differ
        for name, param in model.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param))
    folder = tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder, safe_serialization=True)
    return model.eval(), folder, shape


def test_modules_to_save_lm_head_is_the_adapters_own_copy(tmp_path):
    model, folder, shape = make(tmp_path, modules_to_save=["lm_head"])
    adapter = load_peft_adapter(folder, shape, 16, vocab_modules_served=True)
    assert adapter.vocab_formats == {"lm_head": "modules_to_save"}
    head = adapter.vocab["lm_head"]
    peft_head = model.base_model.model.lm_head.modules_to_save["default"].weight
    torch.testing.assert_close(head.matrix, peft_head, rtol=0, atol=0)
    assert not torch.equal(head.matrix, model.base_model.model.lm_head.original_module.weight)
    with pytest.raises(
        AdapterError, match=r"its own lm_head \(modules_to_save\): this server keeps no room"
    ) as err:
        map_peft_adapter(folder, shape, 16)  # a store or engine without max_vocab_loras
    assert (err.value.code, err.value.field) == ("vocab_modules_unsupported", "modules_to_save")


@torch.inference_mode()
def test_lora_on_embed_tokens_and_lm_head_equals_peft_layers(tmp_path):
    """PEFT's embedding LoRA (F.embedding of A^T, then B, times the scale) and head LoRA are the matrix
    `base + scale * left @ right` the adapter carries, on the saved base layers."""
    model, folder, shape = make(
        tmp_path,
        target_modules=["q_proj", "embed_tokens", "lm_head"],
        rank_pattern={"lm_head": 2},
        alpha_pattern={"embed_tokens": 3},
    )
    adapter = load_peft_adapter(folder, shape, 16, vocab_modules_served=True)
    assert adapter.vocab_formats == {"embed_tokens": "lora", "lm_head": "lora"}
    assert adapter.target_modules == ("q_proj", "embed_tokens", "lm_head")
    embed, head = adapter.vocab["embed_tokens"], adapter.vocab["lm_head"]
    assert (embed.rank, embed.scale, head.rank, head.scale) == (4, 3 / 4, 2, 8 / 2)
    ids = torch.tensor([[0, 5, 95, 17, 5]])
    merged = embed.matrix + embed.scale * embed.left @ embed.right  # [vocab, hidden]
    peft_embed = model.base_model.model.model.embed_tokens
    torch.testing.assert_close(merged[ids], peft_embed(ids), rtol=1e-6, atol=1e-6)
    hidden = torch.randn(1, 5, TINY["hidden_size"])
    merged = head.matrix + head.scale * head.left @ head.right
    torch.testing.assert_close(
        hidden @ merged.T, model.base_model.model.lm_head(hidden), rtol=1e-5, atol=1e-5
    )
    # The saved base layers are the base weights PEFT loads back under the LoRA.
    torch.testing.assert_close(embed.matrix, peft_embed.base_layer.weight, rtol=0, atol=0)


@pytest.mark.parametrize("tying", [False, True])
def test_tied_embeddings_follow_peft(tmp_path, tying):
    """On a tied model, a modules_to_save copy of embed_tokens is the embedding only (PEFT's copy breaks
    the tie) unless ensure_weight_tying ties the head to it."""
    model, folder, shape = make(
        tmp_path, tied=True, modules_to_save=["embed_tokens"], ensure_weight_tying=tying
    )
    adapter = load_peft_adapter(folder, shape, 16, vocab_modules_served=True)
    embed = adapter.vocab["embed_tokens"]
    assert ties_head_to_embedding(embed, shape, adapter.ensure_weight_tying) is tying
    inner = model.base_model.model
    head_weight = inner.lm_head.weight if not tying else inner.lm_head.modules_to_save["default"].weight
    assert torch.equal(head_weight, embed.matrix) is tying


def test_a_resized_vocabulary_is_refused_naming_the_problem(tmp_path):
    _, folder, shape = make(tmp_path, resize=8, modules_to_save=["embed_tokens", "lm_head"])
    with pytest.raises(
        AdapterError, match="has 104 rows where the base vocabulary has 96: its tokenizer added"
    ) as err:
        map_peft_adapter(folder, shape, 16)
    assert (err.value.code, err.value.field) == ("vocab_resized", "modules_to_save")


def test_lora_on_a_resized_embedding_is_refused(tmp_path):
    _, folder, shape = make(tmp_path / "b", resize=8, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match="resized embeddings") as err:
        map_peft_adapter(folder, shape, 16)
    assert (err.value.code, err.value.field) == ("vocab_resized", "target_modules")


def test_shapes_and_values_are_checked_naming_the_field(tmp_path):
    _, folder, shape = make(tmp_path, modules_to_save=["lm_head"])
    tensors = load_file(folder / WEIGHTS)
    name = "base_model.model.lm_head.weight"
    good = tensors[name]
    tensors[name] = torch.zeros(96, 31)
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(
        AdapterError, match=r"lm_head.weight has shape \[96, 31\], but .* is \[96, 32\]"
    ) as err:
        map_peft_adapter(folder, shape, 16)
    assert (err.value.code, err.value.field) == ("shape_mismatch", "modules_to_save")
    tensors[name] = good.clone()
    tensors[name][3, 4] = float("nan")
    save_file(tensors, folder / WEIGHTS)
    with pytest.raises(AdapterError, match="lm_head.weight.* holds NaN") as err:
        load_peft_adapter(folder, shape, 16, vocab_modules_served=True)
    assert err.value.code == "bad_weight_values"


def test_config_and_tensors_must_agree(tmp_path):
    _, folder, shape = make(tmp_path, target_modules=["q_proj", "embed_tokens"])
    config = json.loads((folder / "adapter_config.json").read_text())
    shapes = {n: tuple(t.shape) for n, t in load_file(folder / WEIGHTS).items()}
    untargeted = {**config, "target_modules": ["q_proj"]}
    with pytest.raises(
        AdapterError, match="LoRA on embed_tokens, but target_modules does not name it"
    ) as err:
        check_adapter(untargeted, shapes, shape, 16, vocab_modules_served=True)
    assert err.value.field == "target_modules"
    dora = {**config, "use_dora": True}
    with pytest.raises(AdapterError, match="DoRA on embed_tokens is not served"):
        check_adapter(dora, {n: s for n, s in shapes.items() if "layers" not in n}, shape, 16, True)
    missing = {**config, "modules_to_save": ["lm_head"]}
    with pytest.raises(AdapterError, match="modules_to_save names lm_head, but .* holds no lm_head.weight"):
        check_adapter(missing, shapes, shape, 16, vocab_modules_served=True)
    other = {**config, "modules_to_save": ["score"]}
    with pytest.raises(
        AdapterError, match="modules_to_save names 'score': only embed_tokens and lm_head"
    ) as err:
        check_adapter(other, shapes, shape, 16)
    assert (err.value.code, err.value.field) == ("modules_to_save_unsupported", "modules_to_save")
