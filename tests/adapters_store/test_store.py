"""The store's contract, on both backends: upload forms, versions, resolve, fetch, delete, commit mark."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from adapter_format.checkpoint import load_peft_adapter
from adapters_store import AdapterNotFound, ChecksumError, InvalidName

WEIGHTS = "adapter_model.safetensors"


def test_put_two_files_returns_the_record(store, adapter_dir, files_of):
    record = store.put("acme", "support", files_of(adapter_dir))
    weights = (adapter_dir / WEIGHTS).read_bytes()
    assert (record.name, record.version, record.rank, record.alpha) == ("support", 1, 8, 16.0)
    assert record.target_modules == ("q_proj", "v_proj")
    assert record.sha256 == hashlib.sha256(weights).hexdigest()
    assert record.size_bytes == len(weights)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record.created_at)
    assert set(record.to_dict()) == {
        "name",
        "version",
        "rank",
        "alpha",
        "target_modules",
        "base_model",
        "sha256",
        "size_bytes",
        "created_at",
    }


@pytest.mark.parametrize(
    "form", ["files", "streams", "folder", "tar_gz", "tar_gz_root", "zip", "zip_root", "zip_stream"]
)
def test_every_upload_form_stores_the_same_adapter(store, adapter_dir, files_of, archives, form):
    config, weights = adapter_dir / "adapter_config.json", adapter_dir / WEIGHTS
    if form == "files":
        source = files_of(adapter_dir)
    elif form == "streams":
        source = type(files_of(adapter_dir))(config=open(config, "rb"), weights=open(weights, "rb"))
    elif form == "folder":
        source = adapter_dir
    elif form in ("tar_gz", "tar_gz_root"):
        source = archives.tar_gz(adapter_dir, top=None if form.endswith("root") else "my-adapter")
    elif form in ("zip", "zip_root"):
        source = archives.zip(adapter_dir, top=None if form.endswith("root") else "my-adapter")
    else:
        source = open(archives.zip(adapter_dir), "rb")
    record = store.put("acme", "a", source)
    assert record.sha256 == hashlib.sha256(weights.read_bytes()).hexdigest()
    # Only the two adapter files and the manifest are stored; README.md from save_pretrained is dropped.
    assert sorted(store._list_keys("acme/a/1/")) == ["adapter_config.json", WEIGHTS, "manifest.json"]


def test_versions_count_up_and_get_resolves_latest_or_specific(
    store, adapter_dir, other_adapter_dir, files_of
):
    first = store.put("acme", "a", files_of(adapter_dir))
    second = store.put("acme", "a", files_of(other_adapter_dir))
    other = store.put("acme", "b", files_of(adapter_dir))
    assert (first.version, second.version, other.version) == (1, 2, 1)
    assert store.get("acme", "a") == second
    assert store.get("acme", "a", 1) == first
    assert store.resolve("acme", "a@1") == first
    assert store.resolve("acme", "a") == second
    assert [r.ref for r in store.list("acme")] == ["a@2", "b@1"]
    assert [r.ref for r in store.list("acme", all_versions=True)] == ["a@1", "a@2", "b@1"]
    assert [r.version for r in store.versions("acme", "a")] == [1, 2]


def test_missing_adapters_and_versions_are_not_found(store, adapter_dir, files_of):
    with pytest.raises(AdapterNotFound, match="no adapter named 'nope'"):
        store.get("acme", "nope")
    store.put("acme", "a", files_of(adapter_dir))
    with pytest.raises(AdapterNotFound, match="has no version 7; its versions are 1"):
        store.get("acme", "a", 7)
    with pytest.raises(AdapterNotFound):
        store.versions("acme", "nope")
    assert store.list("nobody") == []


def test_fetch_verifies_and_yields_a_loadable_folder(store, adapter_dir, files_of, tmp_path, model_shape):
    record = store.put("acme", "a", files_of(adapter_dir))
    folder = store.fetch("acme", "a", None, tmp_path / "fetched")
    assert (folder / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()
    assert not list(folder.glob(".*.part"))
    fetched = load_peft_adapter(folder, model_shape, max_lora_rank=16)
    original = load_peft_adapter(adapter_dir, model_shape, max_lora_rank=16)
    assert fetched.rank == record.rank == 8
    for key, module in original.modules.items():
        assert torch.equal(fetched.modules[key].lora_a, module.lora_a)
        assert torch.equal(fetched.modules[key].lora_b, module.lora_b)
    assert store.metrics.num_fetches == 1


def test_tampered_weights_raise_checksum_error(store, adapter_dir, files_of, tmp_path):
    store.put("acme", "a", files_of(adapter_dir))
    weights = bytearray((adapter_dir / WEIGHTS).read_bytes())
    weights[-1] ^= 0xFF  # same size, one bit pattern changed
    store._write(f"acme/a/1/{WEIGHTS}", bytes(weights))
    with pytest.raises(ChecksumError, match="has sha256 [0-9a-f]{64}, but its manifest says") as err:
        store.fetch("acme", "a", 1, tmp_path / "out")
    assert "upload the adapter again" in str(err.value)
    assert not (tmp_path / "out" / WEIGHTS).exists()  # nothing unverified is left under the real name
    store._write(f"acme/a/1/{WEIGHTS}", bytes(weights) + b"extra")
    with pytest.raises(ChecksumError, match="larger than"):
        store.fetch("acme", "a", 1, tmp_path / "out")


def test_delete_one_version_then_all(store, adapter_dir, other_adapter_dir, files_of, keys_of):
    for folder in (adapter_dir, other_adapter_dir, adapter_dir):
        store.put("acme", "a", files_of(folder))
    assert [r.ref for r in store.delete("acme", "a", 2)] == ["a@2"]
    assert [r.version for r in store.versions("acme", "a")] == [1, 3]
    with pytest.raises(AdapterNotFound):
        store.get("acme", "a", 2)
    assert [r.ref for r in store.delete("acme", "a")] == ["a@1", "a@3"]
    assert store.list("acme") == []
    with pytest.raises(AdapterNotFound):
        store.delete("acme", "a")
    # Only tombstones remain: no files, and the numbers are never handed out again.
    assert keys_of(store) == [f"acme/a/{v}/deleted.json" for v in (1, 2, 3)]
    assert store.put("acme", "a", files_of(adapter_dir)).version == 4


def test_deleting_the_latest_falls_back_to_the_previous(store, adapter_dir, other_adapter_dir, files_of):
    first = store.put("acme", "a", files_of(adapter_dir))
    store.put("acme", "a", files_of(other_adapter_dir))
    store.delete("acme", "a", 2)
    assert store.get("acme", "a") == first


def test_tenants_are_isolated(store, adapter_dir, other_adapter_dir, files_of, tmp_path):
    a = store.put("tenant-a", "shared-name", files_of(adapter_dir))
    store.put("tenant-a", "only-a", files_of(adapter_dir))
    b = store.put("tenant-b", "shared-name", files_of(other_adapter_dir))
    # "tenant-a" is a prefix of neither listing's keys: "tenant-ab" must not see tenant-a's adapters.
    assert store.list("tenant-ab") == []
    assert [r.ref for r in store.list("tenant-b")] == ["shared-name@1"]
    assert store.get("tenant-b", "shared-name").sha256 == b.sha256 != a.sha256
    with pytest.raises(AdapterNotFound):
        store.get("tenant-b", "only-a")
    with pytest.raises(AdapterNotFound):
        store.fetch("tenant-b", "only-a", 1, tmp_path / "x")
    with pytest.raises(AdapterNotFound):
        store.delete("tenant-b", "only-a")
    assert [r.ref for r in store.list("tenant-a")] == ["only-a@1", "shared-name@1"]


@pytest.mark.parametrize(
    "tenant, name, message",
    [
        ("acme", "a@2", "contains '@'"),
        ("acme", "a/b", "path separator"),
        ("acme", "..", "contains '..'"),
        ("acme", ".hidden", "starting with a letter or digit"),
        ("acme", "x" * 65, "1-64"),
        ("acme", "", "1-64"),
        ("ac/me", "a", "tenant 'ac/me' contains a path separator"),
        ("../etc", "a", "tenant"),
    ],
)
def test_bad_names_are_refused_before_anything_happens(
    store, adapter_dir, files_of, keys_of, tenant, name, message
):
    with pytest.raises(InvalidName, match=re.escape(message)):
        store.put(tenant, name, files_of(adapter_dir))
    with pytest.raises(InvalidName):
        store.get(tenant, name)
    assert keys_of(store) == []


def test_a_version_without_manifest_is_invisible_and_keeps_its_number(store, adapter_dir, files_of):
    store.put("acme", "a", files_of(adapter_dir))
    # What an upload killed after its files but before its manifest leaves behind:
    store._write("acme/a/2/adapter_config.json", (adapter_dir / "adapter_config.json").read_bytes())
    store._write(f"acme/a/2/{WEIGHTS}", (adapter_dir / WEIGHTS).read_bytes())
    store._write("acme/b/1/adapter_config.json", b"{}")
    assert [r.ref for r in store.list("acme", all_versions=True)] == ["a@1"]
    assert store.get("acme", "a").version == 1
    with pytest.raises(AdapterNotFound):
        store.get("acme", "a", 2)
    with pytest.raises(AdapterNotFound):
        store.get("acme", "b")
    assert store.put("acme", "a", files_of(adapter_dir)).version == 3


def test_an_unreadable_manifest_is_ignored(store, adapter_dir, files_of):
    store.put("acme", "a", files_of(adapter_dir))
    store.put("acme", "a", files_of(adapter_dir))
    store._write("acme/a/2/manifest.json", b"{not json")
    assert store.get("acme", "a").version == 1
    assert [r.ref for r in store.list("acme", all_versions=True)] == ["a@1"]


class Killed(BaseException):
    """Stands for the process dying: not an Exception, so no handler in the store swallows it."""


def test_an_upload_killed_before_its_commit_leaves_nothing_visible(
    store, backend, adapter_dir, files_of, keys_of, monkeypatch
):
    """Killed at the last step: S3 after both files are up, local with the whole folder written but not renamed."""
    seen_before_kill = []
    if backend == "s3":
        real_write = store._write

        def write(key, data):
            if key.endswith("manifest.json"):
                seen_before_kill.extend(keys_of(store))
                raise Killed
            return real_write(key, data)

        monkeypatch.setattr(store, "_write", write)
    else:
        real_rename = os.rename

        def rename(src, dst):
            if Path(dst).name.isdigit():  # the publishing rename of a version folder
                seen_before_kill.extend(sorted(p.name for p in Path(src).iterdir()))
                raise Killed
            return real_rename(src, dst)

        monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Killed):
        store.put("acme", "a", files_of(adapter_dir))
    monkeypatch.undo()
    expected = ["acme/a/1/adapter_config.json", f"acme/a/1/{WEIGHTS}"]
    if backend == "local":
        expected = ["adapter_config.json", WEIGHTS, "manifest.json"]
    assert seen_before_kill == expected
    assert store.list("acme", all_versions=True) == []
    with pytest.raises(AdapterNotFound):
        store.get("acme", "a")
    # S3 keeps the number the dead upload claimed; the local rename never claimed one.
    assert store.put("acme", "a", files_of(adapter_dir)).version == (2 if backend == "s3" else 1)
    assert len(store.list("acme", all_versions=True)) == 1


def test_concurrent_uploads_of_one_name_get_distinct_versions(store, adapter_dir, files_of):
    records, errors = [], []

    def upload():
        try:
            records.append(store.put("acme", "a", files_of(adapter_dir)))
        except Exception as exc:  # collected: an assert in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=upload) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(r.version for r in records) == [1, 2, 3, 4]
    assert [r.version for r in store.versions("acme", "a")] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("configured", "recorded"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),  # a hub id
        ("gpt2", "gpt2"),
        (".loraserve/models/SmolLM2-135M-Instruct", "served-model"),  # the trainer's local folders
        ("/home/me/models/llama", "served-model"),
        ("./llama", "served-model"),
        ("../models/llama", "served-model"),
        ("~/llama", "served-model"),
        ("C:\\models\\llama", "served-model"),
        (None, "served-model"),
    ],
)
def test_base_model_is_a_hub_id_or_the_served_model(make_store, adapter_dir, tmp_path, configured, recorded):
    """A local path in base_model_name_or_path would mean nothing to anyone reading the record."""
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dir, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = configured
    (folder / "adapter_config.json").write_text(json.dumps(config))
    record = make_store(served_model="served-model").put("acme", "a", folder)
    assert record.base_model == recorded
    assert make_store(served_model="served-model").get("acme", "a").base_model == recorded  # the manifest
