"""DoRA uploads: a real PEFT DoRA adapter is stored as format "dora"; a missing, misshapen, non-positive or
non-finite magnitude, or a magnitude without use_dora, is refused naming the problem, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_validation import WEIGHTS, refused


@pytest.fixture(scope="session")
def dora_dir(make_peft_adapter):
    return make_peft_adapter(r=4, lora_alpha=8, use_dora=True)


def test_a_dora_adapter_is_stored_as_dora(store, dora_dir):
    record = store.put("acme", "dora", dora_dir)
    assert record.format == "dora"
    assert store.get("acme", "dora").format == "dora"


def _edit_magnitude(copy_adapter, dora_dir, edit):
    folder = copy_adapter(dora_dir)
    tensors = load_file(folder / WEIGHTS)
    name = next(n for n in tensors if n.endswith("lora_magnitude_vector"))
    edit(tensors, name)
    save_file(tensors, folder / WEIGHTS)
    return folder


def _set(value):
    def edit(tensors, name):
        tensors[name] = tensors[name].clone()
        tensors[name][3] = value

    return edit


@pytest.mark.parametrize(
    "edit, code, message",
    [
        (
            lambda t, n: t.pop(n),
            "missing_magnitude",
            "use_dora is set but its lora_magnitude_vector is missing",
        ),
        (lambda t, n: t.update({n: t[n][:-1].clone()}), "shape_mismatch", r"lora_magnitude_vector has shape"),
        (_set(0.0), "bad_weight_values", "must be positive"),
        (_set(-1.5), "bad_weight_values", "must be positive"),
        (_set(float("nan")), "bad_weight_values", "holds NaN"),
        (_set(float("inf")), "bad_weight_values", "infinite"),
    ],
    ids=["missing", "shape", "zero", "negative", "nan", "inf"],
)
def test_bad_magnitudes_are_refused(store, keys_of, copy_adapter, dora_dir, edit, code, message):
    refused(store, keys_of, _edit_magnitude(copy_adapter, dora_dir, edit), code, message)


def test_a_magnitude_without_use_dora_is_refused(store, keys_of, copy_adapter, dora_dir):
    folder = copy_adapter(dora_dir, {"use_dora": False})
    error = refused(store, keys_of, folder, "unexpected_tensor", "does not set use_dora")
    assert error.field == "use_dora"


def test_use_dora_that_is_not_a_boolean_is_refused(store, keys_of, copy_adapter, dora_dir):
    refused(
        store, keys_of, copy_adapter(dora_dir, {"use_dora": "yes"}), "bad_config", "use_dora must be true"
    )
    assert json.loads((dora_dir / "adapter_config.json").read_text())["use_dora"] is True
    assert any(n.endswith("lora_magnitude_vector") for n in load_file(dora_dir / WEIGHTS))
    assert torch.is_tensor(next(iter(load_file(dora_dir / WEIGHTS).values())))


def test_a_resized_embedding_is_refused_naming_it(store, keys_of, copy_adapter, dora_dir):
    """PEFT saves the whole embedding when the tokenizer added tokens (save_embedding_layers)."""
    folder = copy_adapter(dora_dir)
    tensors = load_file(folder / WEIGHTS)
    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(514, 64)
    save_file(tensors, folder / WEIGHTS)
    refused(
        store,
        keys_of,
        folder,
        "vocab_resized",
        r"embed_tokens has 514 rows where the base vocabulary has 512: its tokenizer added tokens",
    )
