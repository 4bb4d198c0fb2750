"""A local store's files reach the disk cache as hard links (no copy written), still checked by sha256
(once per unchanged file and process), and copied where a link is impossible (another filesystem)."""

from __future__ import annotations

import errno
import hashlib
import os
import time

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


@pytest.fixture
def hashes(monkeypatch):
    """Counts whole-file hashes of the weights (a linked file's; a copy is hashed as it streams)."""
    calls = []
    real = hashlib.file_digest

    def counting(f, digest):
        if f.name.endswith(f"{WEIGHTS}.part"):
            calls.append(f.name)
        return real(f, digest)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    return calls


def age(path, seconds=60):
    """As if the file had been written `seconds` ago."""
    then = time.time_ns() - seconds * 10**9
    os.utime(path, ns=(then, then))


def test_an_unchanged_linked_file_is_hashed_once_per_process(
    local_store, adapter_dir, files_of, tmp_path, hashes
):
    record = local_store.put("acme", "a", files_of(adapter_dir))
    stored = tmp_path / "store" / "acme" / "a" / "1" / WEIGHTS
    age(stored)
    cache = DiskCache(local_store, tmp_path / "cache", 1 << 30)
    for _ in range(3):  # fetched, dropped (as an eviction would), fetched again
        cached = cache.fetch_record("acme", record)
        assert not cached.hit
        assert (cached.path / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()
        cache.discard("acme", "a")
    assert len(hashes) == 1


def test_a_linked_file_changed_after_its_hash_is_hashed_again_and_refused(
    local_store, adapter_dir, files_of, tmp_path, hashes
):
    record = local_store.put("acme", "a", files_of(adapter_dir))
    stored = tmp_path / "store" / "acme" / "a" / "1" / WEIGHTS
    age(stored)
    cache = DiskCache(local_store, tmp_path / "cache", 1 << 30)
    cache.fetch_record("acme", record)
    cache.discard("acme", "a")
    weights = bytearray(stored.read_bytes())
    weights[-1] ^= 0xFF  # same size, same inode: only the mtime tells
    with open(stored, "r+b") as f:
        f.write(weights)
    with pytest.raises(ChecksumError, match="has sha256"):
        cache.fetch_record("acme", record)
    assert len(hashes) == 2


def test_a_file_written_within_the_last_second_is_not_remembered(
    local_store, adapter_dir, files_of, tmp_path, hashes
):
    """A write in the same clock tick would leave its mtime as it was (git's racy-file rule)."""
    record = local_store.put("acme", "a", files_of(adapter_dir))
    cache = DiskCache(local_store, tmp_path / "cache", 1 << 30)
    cache.fetch_record("acme", record)
    cache.discard("acme", "a")
    cache.fetch_record("acme", record)
    assert len(hashes) == 2
