"""MergedAdapterSource: merge ids load from their folder, every other id goes to the store's source, and
the wrapper pickles (into loader processes) with what it wraps."""

from __future__ import annotations

import pickle

import pytest

from adapter_format.errors import AdapterError
from adapter_format.names import format_merge_id, parse_merge_id
from adapters_store.merged_source import MergedAdapterSource, merge_folder

KEY = "0123456789abcdef" * 2


class Inner:
    """A stand-in for StoreAdapterSource: records what reaches it."""

    shape, max_lora_rank = None, 16

    def __init__(self):
        self.loaded: list[str] = []

    def resolve(self, ref: str) -> str:
        if "@" not in ref:
            raise AdapterError("unknown_adapter", f"unknown adapter {ref!r}")
        return ref

    def load(self, adapter_id, read=None):
        self.loaded.append(adapter_id)
        return "from the store"

    def drain(self) -> list:
        return ["records"]


def test_merge_ids_round_trip_and_never_name_a_stored_version():
    merge_id = format_merge_id("acme", KEY)
    assert merge_id == f"acme/merge+{KEY}" and parse_merge_id(merge_id) == ("acme", KEY)
    for other in ("acme/merge@1", "acme/merge+XYZ", f"merge+{KEY}", f"acme/merge-{KEY}@1"):
        assert parse_merge_id(other) is None
    with pytest.raises(ValueError):
        format_merge_id("acme", "short")


def test_merge_ids_load_from_their_folder_and_others_from_the_store(tmp_path):
    inner = Inner()
    source = MergedAdapterSource(inner, tmp_path)
    merge_id = format_merge_id("acme", KEY)
    assert source.resolve(merge_id) == merge_id
    assert source.resolve("acme/a@1") == "acme/a@1"
    with pytest.raises(AdapterError) as missing:
        source.load(merge_id, lambda folder: folder)
    assert missing.value.code == "unknown_adapter" and str(tmp_path) not in str(missing.value)
    folder = merge_folder(tmp_path, "acme", KEY)
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"")
    assert source.load(merge_id, lambda folder: folder) == folder
    assert source.load("acme/a@1", lambda folder: folder) == "from the store"
    assert inner.loaded == ["acme/a@1"]  # the merge never reached the store
    assert source.drain() == ["records"]  # the loader-process hooks pass through

    copy = pickle.loads(pickle.dumps(source))
    assert copy.directory == tmp_path and copy.load(merge_id, lambda folder: folder) == folder
