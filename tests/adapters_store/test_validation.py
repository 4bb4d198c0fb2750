"""Every content check, on both backends: each failure has its code and message, and nothing is written."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from adapters_store import AdapterFiles, InvalidAdapter

WEIGHTS = "adapter_model.safetensors"
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def refused(store, keys_of, source, code: str, message: str, tenant: str = "acme") -> InvalidAdapter:
    with pytest.raises(InvalidAdapter, match=message) as err:
        store.put(tenant, "bad", source)
    assert err.value.code == code
    assert keys_of(store) == [], "validation must fail before anything is written"
    return err.value


@pytest.mark.parametrize(
    "lora, code, message",
    [
        (dict(bias="all"), "bias_unsupported", r"train biases \(bias != 'none'\)"),
        (
            dict(modules_to_save=["lm_head"]),
            "vocab_modules_unsupported",
            r"its own lm_head \(modules_to_save\): this server keeps no room .* --max-vocab-loras",
        ),
        (
            dict(target_modules=("q_proj", "embed_tokens")),
            "vocab_modules_unsupported",
            r"its own embed_tokens \(lora\)",
        ),
        (dict(llama=dict(hidden_size=32)), "shape_mismatch", "trained on another model"),
        (
            dict(llama=dict(num_hidden_layers=3)),
            "layer_out_of_range",
            "is for layer 2, but the base model has 2",
        ),
        (dict(r=32, lora_alpha=32), "rank_too_large", "adapter rank 32 is greater than max_lora_rank 16"),
    ],
    ids=["bias", "modules_to_save", "embedding_target", "other_hidden_size", "extra_layer", "rank"],
)
def test_real_peft_adapters_the_engine_cannot_serve(
    store, keys_of, make_peft_adapter, files_of, lora, code, message
):
    folder = make_peft_adapter(**lora)
    refused(store, keys_of, files_of(folder), code, message)


def test_rank_limit_comes_from_the_store_config(make_store, keys_of, adapter_dir, files_of):
    store = make_store(max_lora_rank=4)
    error = refused(
        store, keys_of, files_of(adapter_dir), "rank_too_large", "is greater than max_lora_rank 4"
    )
    assert "--max-lora-rank" in error.message


def test_not_lora(store, keys_of, adapter_dir, copy_adapter):
    folder = copy_adapter(adapter_dir, {"peft_type": "IA3"})
    refused(store, keys_of, folder, "not_lora", "peft_type is 'IA3'; only LORA adapters are supported")


def test_config_that_is_not_json(store, keys_of, adapter_dir, copy_adapter):
    folder = copy_adapter(adapter_dir)
    (folder / "adapter_config.json").write_text("{peft_type: LORA")
    refused(store, keys_of, folder, "bad_config", "is not valid JSON")


def test_missing_config(store, keys_of, adapter_dir, copy_adapter, archives):
    folder = copy_adapter(adapter_dir)
    (folder / "adapter_config.json").unlink()
    refused(store, keys_of, folder, "missing_config", "a PEFT adapter folder needs adapter_config.json")
    refused(store, keys_of, archives.tar_gz(folder), "missing_config", "adapter_config.json")
    refused(store, keys_of, archives.zip(folder, top=None), "missing_config", "adapter_config.json")


def test_missing_weights(store, keys_of, adapter_dir, copy_adapter):
    folder = copy_adapter(adapter_dir)
    (folder / WEIGHTS).unlink()
    refused(store, keys_of, folder, "missing_weights", f"the upload has no {WEIGHTS}")


def test_pickle_checkpoints_are_refused_by_name(store, keys_of, make_peft_adapter, archives):
    folder = make_peft_adapter(safe=False)
    assert (folder / "adapter_model.bin").exists()
    message = "adapter_model.bin is a pickled checkpoint; pickles are never loaded"
    refused(store, keys_of, folder, "pickle_refused", message)
    refused(store, keys_of, archives.tar_gz(folder), "pickle_refused", message)
    refused(store, keys_of, archives.zip(folder), "pickle_refused", message)
    parts = {p.name: p for p in folder.iterdir()}
    with pytest.raises(InvalidAdapter, match=message) as err:
        AdapterFiles.from_named(parts)
    assert err.value.code == "pickle_refused"


def test_a_pickle_renamed_to_safetensors_is_refused_by_content(
    store, keys_of, make_peft_adapter, copy_adapter
):
    folder = copy_adapter(make_peft_adapter(safe=False))
    (folder / "adapter_model.bin").rename(folder / WEIGHTS)
    refused(
        store,
        keys_of,
        folder,
        "bad_weights",
        "looks like a pickled PyTorch checkpoint, which is never loaded",
    )


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda data: data[:5], "too short for a safetensors header"),
        # Uploads stream: the header's length is checked against the bound before the file's size is known.
        (lambda data: struct.pack("<Q", 1 << 40) + data[8:], "its header is 1099511627776 bytes"),
        (lambda data: data[:8] + b"[" + data[9:], "not valid JSON"),
        (lambda data: data[:-4], r"but its header describes \d+ \(truncated\)"),
        (lambda data: data + b"\0" * 4, r"more than the \d+ bytes its header describes \(padded\)"),
    ],
    ids=["short", "huge_header_length", "bad_json", "truncated", "padded"],
)
def test_corrupt_safetensors_files(store, keys_of, adapter_dir, copy_adapter, corrupt, message):
    folder = copy_adapter(adapter_dir)
    weights = folder / WEIGHTS
    weights.write_bytes(corrupt(weights.read_bytes()))
    refused(store, keys_of, folder, "bad_weights", message)


def test_tensor_not_of_a_decoder_projection(store, keys_of, adapter_dir, copy_adapter):
    from safetensors.torch import load_file, save_file

    folder = copy_adapter(adapter_dir)
    tensors = load_file(folder / WEIGHTS)
    name = next(iter(tensors))
    tensors[name.replace("lora_A.weight", "lora_embedding_A")] = tensors[name][0].clone()
    save_file(tensors, folder / WEIGHTS)
    refused(store, keys_of, folder, "unexpected_tensor", "is not a LoRA weight of a decoder-layer projection")


def test_stray_files_are_refused_but_text_files_are_dropped(
    store, keys_of, adapter_dir, copy_adapter, files_of
):
    folder = copy_adapter(adapter_dir)
    (folder / "LICENSE").write_text("Apache-2.0")
    (folder / "notes.txt").write_text("trained on...")
    assert store.put("acme", "ok", folder).version == 1
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidAdapter, match="unexpected file tokenizer.json") as err:
        store.put("acme", "ok", folder)
    assert err.value.code == "unexpected_file"
    (folder / "tokenizer.json").unlink()
    shutil.copy(folder / WEIGHTS, folder / "model.safetensors")
    with pytest.raises(InvalidAdapter, match=f"must be named {WEIGHTS}"):
        store.put("acme", "ok", folder)


def test_from_named_picks_the_two_files(adapter_dir):
    files = AdapterFiles.from_named(
        {"README.md": b"hi", "adapter_config.json": b"{}", WEIGHTS: adapter_dir / WEIGHTS}
    )
    assert files.config == b"{}"
    with pytest.raises(InvalidAdapter, match="has no adapter_model.safetensors") as err:
        AdapterFiles.from_named({"adapter_config.json": b"{}"})
    assert err.value.code == "missing_weights"
    with pytest.raises(InvalidAdapter, match="has no adapter_config.json"):
        AdapterFiles.from_named({WEIGHTS: b""})


def test_invalid_adapter_keeps_the_engine_code(store, adapter_dir, copy_adapter):
    folder = copy_adapter(adapter_dir, {"r": 0})
    with pytest.raises(InvalidAdapter) as err:
        store.put("acme", "a", folder)
    assert err.value.code == "bad_rank"
    assert isinstance(err.value, ValueError)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 0


def test_own_embedding_and_head_are_stored_where_the_engine_keeps_room(
    make_store, keys_of, make_peft_adapter, files_of
):
    """A server started with --max-vocab-loras takes modules_to_save and LoRA on embed_tokens / lm_head;
    the record says which (`vocab_modules`, shown by /v1/adapters) and survives the manifest."""
    store = make_store(vocab_modules_served=True)
    saved = make_peft_adapter(modules_to_save=["lm_head"])
    record = store.put("acme", "head", files_of(saved))
    assert record.vocab_modules == {"lm_head": "modules_to_save"} and record.format == "lora"
    lora = make_peft_adapter(target_modules=("q_proj", "embed_tokens"))
    assert store.put("acme", "embed", files_of(lora)).vocab_modules == {"embed_tokens": "lora"}
    assert store.get("acme", "head").vocab_modules == {"lm_head": "modules_to_save"}
    assert store.get("acme", "embed").target_modules == ("q_proj", "embed_tokens")
    # a resized vocabulary stays refused, naming the problem
    resized = make_peft_adapter(modules_to_save=["lm_head"], llama=dict(vocab_size=520))
    with pytest.raises(InvalidAdapter, match="520 rows where the base vocabulary has 512") as err:
        store.put("acme", "grown", files_of(resized))
    assert (err.value.code, err.value.field) == ("vocab_resized", "modules_to_save")
