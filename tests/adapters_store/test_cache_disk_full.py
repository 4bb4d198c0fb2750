"""The disk cache on a full disk: it evicts unpinned entries (least recently used first) to make room and
tries again, keeps a free-space floor, and when everything left is in use fails with DiskFull, leaves no
partial download and marks itself out of room for every process until there is room again.

The disk is played by `SmallDisk`: a fixed capacity over the cache folder's files, whose free space the
cache reads (disk_space.free_bytes) and whose writes fail with ENOSPC past it (the store's download writes,
at the `open` the store writes through). The store copies (no hard links), as from S3."""

from __future__ import annotations

import errno
import os

import pytest

import adapters_store.base as store_base
from adapters_store import CountingMetrics, DiskCache, DiskFull, StoreConfig, disk_space, open_store
from adapters_store.cache_room import NoRoomMark
from adapters_store.engine_source import StoreAdapterSource

NAMES = ("a", "b", "c", "d")


class SmallDisk:
    def __init__(self, root, capacity: int, free_slack: int = 0):
        self.root, self.capacity = str(root), capacity
        self.free_slack = free_slack  # bytes the filesystem reports free but will not let us write
        self.refused_writes = 0

    def used(self) -> int:
        total = 0
        for folder, _, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.path.getsize(os.path.join(folder, name))
                except FileNotFoundError:
                    pass
        return total

    def free_bytes(self, path) -> int:
        return max(0, self.capacity - self.used()) + self.free_slack

    def open(self, file, mode="r", *args, **kwargs):
        if "w" not in mode or not str(file).startswith(self.root):
            return open(file, mode, *args, **kwargs)
        return _Limited(open(file, mode, buffering=0), self)


class _Limited:
    def __init__(self, file, disk: SmallDisk):
        self.file, self.disk = file, disk

    def write(self, data) -> int:
        if self.disk.used() + len(data) > self.disk.capacity:
            self.disk.refused_writes += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.fixture
def setup(tmp_path, model_shape, adapter_dir, files_of, monkeypatch):
    """make(capacity_entries, free_slack_entries=0, min_free_entries=0) -> (cache, disk, records, entry_bytes)."""
    store = open_store(StoreConfig(url=f"file://{tmp_path}/store"), model_shape, CountingMetrics())
    monkeypatch.setattr(store, "_link", lambda key, dest: False)  # copy, as from S3
    records = {name: store.put("acme", name, files_of(adapter_dir)) for name in NAMES}
    probe = store.fetch("acme", "a", 1, tmp_path / "probe")
    entry_bytes = sum(f.stat().st_size for f in probe.iterdir())

    def make(capacity_entries: float, free_slack_entries: float = 0, min_free_entries: float = 0):
        disk = SmallDisk(
            tmp_path / "cache", int(capacity_entries * entry_bytes), int(free_slack_entries * entry_bytes)
        )
        monkeypatch.setattr(disk_space, "free_bytes", disk.free_bytes)
        monkeypatch.setattr(store_base, "open", disk.open, raising=False)
        cache = DiskCache(
            store,
            tmp_path / "cache",
            1 << 30,
            CountingMetrics(),
            min_free_bytes=int(min_free_entries * entry_bytes),
        )
        return cache, disk, records, entry_bytes

    return make


def cached(cache) -> list[str]:
    return sorted(name for _, name, _ in cache.cached_versions())


def leftovers(cache) -> list[str]:
    return [p.name for p in cache.directory.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_a_disk_too_small_for_the_budget_evicts_before_it_fills(setup):
    """Room for two and a half entries, a budget of a gigabyte: the third fetch evicts the oldest first."""
    cache, disk, records, _ = setup(2.5)
    for name in ("a", "b", "c"):
        cache.fetch_record("acme", records[name])
    assert cached(cache) == ["b", "c"]
    assert disk.refused_writes == 0 and not cache.out_of_room()


def test_a_write_that_meets_a_full_disk_evicts_and_retries(setup):
    """The filesystem says there is room (reserved blocks, another writer) but the write fails with ENOSPC:
    the partial download goes, the least recently used entry is evicted and the fetch succeeds."""
    cache, disk, records, _ = setup(2.5, free_slack_entries=5)
    cache.fetch_record("acme", records["a"])
    cache.fetch_record("acme", records["b"])
    cache.fetch_record("acme", records["a"])  # a is now the most recently used
    fetched = cache.fetch_record("acme", records["c"])
    assert disk.refused_writes >= 1, "the write was meant to meet the full disk"
    assert not fetched.hit and (fetched.path / "adapter_model.safetensors").is_file()
    assert cached(cache) == ["a", "c"]
    assert leftovers(cache) == [] and not cache.out_of_room()
    assert cache.metrics.num_evictions == 1


def test_an_insert_from_memory_that_meets_a_full_disk_evicts_and_retries(setup, monkeypatch):
    """The disk cache filled behind a load streamed into memory (DiskCache.insert): a full disk is met as
    a download meets it, by evicting the least recently used entry and writing again."""
    import adapters_store.cache as cache_module

    cache, disk, records, _ = setup(2.5, free_slack_entries=5)
    monkeypatch.setattr(cache_module, "open", disk.open, raising=False)
    cache.fetch_record("acme", records["a"])
    cache.fetch_record("acme", records["b"])
    cache.fetch_record("acme", records["a"])  # a is now the most recently used
    config, weights = cache.store.read_record("acme", records["c"])
    assert cache.insert("acme", records["c"], config, weights)
    assert disk.refused_writes >= 1, "the write was meant to meet the full disk"
    assert cached(cache) == ["a", "c"]
    assert leftovers(cache) == [] and not cache.out_of_room()
    assert cache.fetch_record("acme", records["c"]).hit
    assert not cache.insert("acme", records["c"], config, weights)  # cached already


def test_with_everything_in_use_the_fetch_fails_cleanly_and_the_cache_says_so(setup, tmp_path):
    cache, disk, records, entry_bytes = setup(2.5, free_slack_entries=5)
    with cache.checkout("acme", records["a"]), cache.checkout("acme", records["b"]):
        with pytest.raises(DiskFull, match="disk is full") as err:
            cache.fetch_record("acme", records["c"])
        assert err.value.code == "insufficient_storage"
        assert str(tmp_path) not in str(err.value), "no path in what callers may see"
        assert cached(cache) == ["a", "b"] and leftovers(cache) == []
        assert cache.out_of_room()
        other_process = DiskCache(cache.store, cache.directory, 1 << 30)  # another process on the directory
        assert other_process.out_of_room()
    # The pins are gone: the next fetch makes room and clears the mark for everyone.
    cache.fetch_record("acme", records["c"])
    assert cached(cache) == ["b", "c"]
    assert not cache.out_of_room() and not other_process.out_of_room()


def test_space_freed_by_hand_clears_the_state_without_a_fetch(setup):
    cache, disk, records, entry_bytes = setup(2.5, free_slack_entries=5)
    with cache.checkout("acme", records["a"]), cache.checkout("acme", records["b"]):
        with pytest.raises(DiskFull):
            cache.fetch_record("acme", records["c"])
    assert cache.out_of_room()
    disk.capacity += entry_bytes // 2
    assert cache.out_of_room(), "not yet the room that was lacking"
    disk.capacity += 2 * entry_bytes  # the operator freed space
    assert not cache.out_of_room()


def test_the_free_space_floor_is_kept(setup):
    """Four entries of disk, a floor of one and a half: never more than two entries after a fetch."""
    cache, disk, records, entry_bytes = setup(4, min_free_entries=1.5)
    for name in NAMES:
        cache.fetch_record("acme", records[name])
        assert len(cached(cache)) <= 2
    assert cached(cache) == ["c", "d"]
    assert disk.refused_writes == 0


def test_a_load_through_a_full_cache_fails_that_adapter_alone_with_its_reason(setup, model_shape):
    from adapter_format.errors import AdapterError

    cache, disk, records, _ = setup(2.5, free_slack_entries=5)
    source = StoreAdapterSource(cache.store, cache, model_shape, 16)
    with cache.checkout("acme", records["a"]), cache.checkout("acme", records["b"]):
        with pytest.raises(AdapterError) as err:
            source.load("acme/c@1")
    assert err.value.code == "insufficient_storage"
    assert "disk is full" in str(err.value) and str(cache.directory) not in str(err.value)
    assert source.load("acme/c@1").rank == 8  # once there is room again


def test_the_mark_is_rewritten_in_place(tmp_path):
    mark = NoRoomMark(tmp_path)
    assert mark.read() is None
    inode = os.stat(mark.path).st_ino
    mark.set(123, 4567)
    assert mark.read() == (123, 4567)
    mark.clear()
    assert mark.read() is None and os.stat(mark.path).st_ino == inode
