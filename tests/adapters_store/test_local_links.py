"""A local store's files reach the disk cache as hard links (no copy written), still checked by sha256,
and copied where a link is impossible (another filesystem)."""

from __future__ import annotations

import errno
import os

import pytest

from adapters_store import ChecksumError, CountingMetrics, DiskCache, StoreConfig, open_store

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def local_store(tmp_path, model_shape):
    return open_store(StoreConfig(url=f"file://{tmp_path}/store"), model_shape, CountingMetrics())


def test_a_fetch_from_a_local_store_links_the_weights(local_store, adapter_dir, files_of, tmp_path):
    record = local_store.put("acme", "a", files_of(adapter_dir))
    cached = DiskCache(local_store, tmp_path / "cache", 1 << 30).fetch_record("acme", record)
    stored = tmp_path / "store" / "acme" / "a" / "1" / WEIGHTS
    assert os.path.samestat(os.stat(cached.path / WEIGHTS), os.stat(stored))
    assert (cached.path / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()


def test_a_linked_file_that_was_tampered_with_fails_its_checksum(
    local_store, adapter_dir, files_of, tmp_path
):
    local_store.put("acme", "a", files_of(adapter_dir))
    weights = bytearray((adapter_dir / WEIGHTS).read_bytes())
    weights[-1] ^= 0xFF  # same size: only the checksum can tell
    stored = tmp_path / "store" / "acme" / "a" / "1" / WEIGHTS
    stored.write_bytes(bytes(weights))  # in place, so a link would carry the change
    with pytest.raises(ChecksumError, match="has sha256"):
        local_store.fetch("acme", "a", 1, tmp_path / "out")
    assert not (tmp_path / "out" / WEIGHTS).exists()
    assert not list((tmp_path / "out").glob(".*.part"))


def test_where_links_are_impossible_the_files_are_copied(
    local_store, adapter_dir, files_of, tmp_path, monkeypatch
):
    record = local_store.put("acme", "a", files_of(adapter_dir))

    def cross_device(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    cached = DiskCache(local_store, tmp_path / "cache", 1 << 30).fetch_record("acme", record)
    stored = tmp_path / "store" / "acme" / "a" / "1" / WEIGHTS
    assert not os.path.samestat(os.stat(cached.path / WEIGHTS), os.stat(stored))
    assert (cached.path / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()
