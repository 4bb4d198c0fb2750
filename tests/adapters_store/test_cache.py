"""The disk cache: LRU by bytes, hit/miss counting, pins, one download under concurrency, restarts, and
several processes sharing one directory."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import threading

import pytest

from adapter_format.checkpoint import load_peft_adapter
from adapters_store import ChecksumError, CountingMetrics, DiskCache, StoreConfig, open_store
from adapters_store.cache_room import ROOM_FILE

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def local_store(tmp_path, model_shape):
    return open_store(StoreConfig(url=f"file://{tmp_path}/store"), model_shape, CountingMetrics())


@pytest.fixture
def three_adapters(local_store, adapter_dir, files_of, tmp_path):
    """Records of a@1, b@1, c@1 and the bytes each takes in the cache (one probe fetch measures it)."""
    records = [local_store.put("acme", name, files_of(adapter_dir)) for name in ("a", "b", "c")]
    probe = local_store.fetch("acme", "a", 1, tmp_path / "probe")
    entry_bytes = sum(f.stat().st_size for f in probe.iterdir())
    return records, entry_bytes


def make_cache(store, tmp_path, max_bytes):
    return DiskCache(store, tmp_path / "cache", max_bytes, CountingMetrics())


def test_hits_and_misses_are_counted(local_store, three_adapters, tmp_path, model_shape):
    (a, _, _), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    first = cache.fetch("acme", "a")
    second = cache.fetch_record("acme", a)
    assert (first.hit, second.hit) == (False, True)
    assert first.path == second.path
    assert (cache.metrics.num_misses, cache.metrics.num_hits) == (1, 1)
    assert cache.total_bytes == entry_bytes
    assert load_peft_adapter(second.path, model_shape, 16).rank == 8


def test_least_recently_used_is_evicted_by_bytes(local_store, three_adapters, tmp_path):
    (a, b, c), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, 2 * entry_bytes)  # room for two
    path_b = cache.fetch_record("acme", b).path
    cache.fetch_record("acme", a)
    cache.fetch_record("acme", b)  # b is now the most recently used
    cache.fetch_record("acme", c)  # over budget: a goes
    assert cache.metrics.num_evictions == 1
    assert cache.metrics.evicted_bytes == entry_bytes
    assert cache.total_bytes == 2 * entry_bytes
    assert path_b.is_dir()
    assert cache.fetch_record("acme", b).hit
    assert not cache.fetch_record("acme", a).hit  # downloaded again, evicting c
    assert sorted(p.name for p in (tmp_path / "cache/acme").iterdir()) == ["a", "b", "c"]
    assert not (tmp_path / "cache/acme/c").joinpath(f"1-{c.sha256}").exists()


def test_a_checked_out_adapter_is_never_evicted(local_store, three_adapters, tmp_path):
    (a, b, c), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, entry_bytes)  # room for one
    with cache.checkout("acme", a) as pinned:
        cache.fetch_record("acme", b)
        cache.fetch_record("acme", c)  # evicts b, never the pinned a
        assert (pinned.path / WEIGHTS).is_file()
        assert cache.total_bytes == 2 * entry_bytes  # over budget while the pin holds
    cache.fetch_record("acme", b)
    assert not cache.fetch_record("acme", a).hit  # unpinned, a was evicted in turn


def test_concurrent_fetches_of_one_adapter_download_once(local_store, three_adapters, tmp_path):
    (a, _, _), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    start = threading.Barrier(8)
    results, errors = [], []

    def fetch():
        start.wait()
        try:
            results.append(cache.fetch_record("acme", a))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert cache.metrics.num_misses == 1
    assert cache.metrics.num_hits == 7
    assert len({r.path for r in results}) == 1
    assert local_store.metrics.num_fetches == 2  # the fixture's probe fetch, then exactly one more


def test_a_restart_reindexes_the_cache(local_store, three_adapters, tmp_path):
    (a, b, _), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    cache.fetch_record("acme", a)
    cache.fetch_record("acme", b)
    (tmp_path / "cache" / ".tmp-leftover").mkdir()
    again = make_cache(local_store, tmp_path, 10 * entry_bytes)
    assert len(again) == 2 and again.total_bytes == 2 * entry_bytes
    assert again.fetch_record("acme", a).hit
    assert not (tmp_path / "cache" / ".tmp-leftover").exists()
    smaller = make_cache(local_store, tmp_path, entry_bytes)  # a smaller budget evicts at start, oldest first
    assert len(smaller) == 1
    assert smaller.fetch_record("acme", a).hit  # a was used last


def test_discard_drops_a_deleted_adapter(local_store, three_adapters, tmp_path):
    (a, _, _), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    path = cache.fetch_record("acme", a).path
    assert cache.discard("acme", "a") == 1
    assert not path.exists() and len(cache) == 0


def test_a_corrupt_download_is_not_cached(local_store, three_adapters, tmp_path):
    (a, _, _), entry_bytes = three_adapters
    local_store._write(f"acme/a/1/{WEIGHTS}", b"tampered")
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    with pytest.raises(ChecksumError):
        cache.fetch_record("acme", a)
    assert len(cache) == 0
    left = [p.name for p in (tmp_path / "cache").iterdir() if p.name != ROOM_FILE]  # made at start
    assert left in ([], ["acme"])
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_tenants_do_not_share_cache_entries(local_store, adapter_dir, files_of, tmp_path):
    a = local_store.put("tenant-a", "same", files_of(adapter_dir))
    b = local_store.put("tenant-b", "same", files_of(adapter_dir))
    assert a.sha256 == b.sha256
    cache = make_cache(local_store, tmp_path, 1 << 30)
    assert not cache.fetch_record("tenant-a", a).hit
    assert not cache.fetch_record("tenant-b", b).hit
    assert cache.fetch_record("tenant-a", a).path != cache.fetch_record("tenant-b", b).path


def test_the_cache_works_in_front_of_s3(s3_endpoint, s3_bucket, adapter_dir, files_of, tmp_path, model_shape):
    store = open_store(
        StoreConfig(url=f"s3://{s3_bucket}", endpoint_url=s3_endpoint), model_shape, CountingMetrics()
    )
    record = store.put("acme", "a", files_of(adapter_dir))
    cache = make_cache(store, tmp_path, 1 << 30)
    assert not cache.fetch("acme", "a").hit
    with cache.checkout("acme", record) as cached:
        assert cached.hit and (cached.path / WEIGHTS).read_bytes() == (adapter_dir / WEIGHTS).read_bytes()


def test_caches_on_one_directory_share_entries_and_respect_each_others_pins(
    local_store, three_adapters, tmp_path
):
    """Two instances stand for two processes: flock separates open descriptors, not processes."""
    (a, b, c), entry_bytes = three_adapters
    first = make_cache(local_store, tmp_path, entry_bytes)  # room for one
    second = make_cache(local_store, tmp_path, entry_bytes)
    with first.checkout("acme", a) as pinned:
        assert second.fetch_record("acme", a).hit  # downloaded by the other one
        second.fetch_record("acme", b)  # over budget, but a is checked out by `first`
        assert (pinned.path / WEIGHTS).is_file()
        assert second.total_bytes == first.total_bytes == 2 * entry_bytes
    second.fetch_record("acme", c)  # a and b are free now: both go, oldest first
    assert len(first) == 1 and first.fetch_record("acme", c).hit
    assert second.metrics.num_evictions == 2


def test_a_download_in_progress_elsewhere_survives_a_start(local_store, three_adapters, tmp_path):
    (a, _, _), entry_bytes = three_adapters
    make_cache(local_store, tmp_path, entry_bytes)
    busy, stale = tmp_path / "cache/.tmp-busy", tmp_path / "cache/.trash-stale"
    busy.mkdir()
    stale.mkdir()
    fd = os.open(busy, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a downloading process holds it
        make_cache(local_store, tmp_path, entry_bytes)
        assert busy.is_dir() and not stale.exists()
    finally:
        os.close(fd)
    make_cache(local_store, tmp_path, entry_bytes)
    assert not busy.exists()


def _churn(store_url, shape, cache_dir, max_bytes, records, rounds, errors):
    """In a spawned process: fetch the adapters in turn through a tiny shared cache, reading each while
    it is checked out."""
    from adapters_store import DiskCache, StoreConfig, open_store

    cache = DiskCache(open_store(StoreConfig(url=store_url), shape), cache_dir, max_bytes)
    for i in range(rounds):
        for record in records[i % 2 :] + records[: i % 2]:
            try:
                with cache.checkout("acme", record) as cached:
                    if len((cached.path / WEIGHTS).read_bytes()) != record.size_bytes:
                        errors.put(f"short read of {record.name}")
            except Exception as exc:
                errors.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.slow
def test_processes_sharing_a_directory_never_read_a_folder_another_evicts(
    local_store, three_adapters, tmp_path, model_shape
):
    records, entry_bytes = three_adapters
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    args = (f"file://{tmp_path}/store", model_shape, tmp_path / "cache", entry_bytes, records, 15, errors)
    processes = [context.Process(target=_churn, args=args) for _ in range(3)]
    for process in processes:
        process.start()
    _churn(*args)  # this process churns too
    for process in processes:
        process.join(120)
    assert [process.exitcode for process in processes] == [0, 0, 0]
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []
    cache = make_cache(local_store, tmp_path, entry_bytes)
    assert len(cache) == 1  # back within budget once nothing is checked out
    assert not list((tmp_path / "cache").glob(".t*"))


def test_a_cached_folder_missing_a_file_is_fetched_again(local_store, three_adapters, tmp_path):
    (a, _, _), entry_bytes = three_adapters
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    path = cache.fetch_record("acme", a).path
    (path / WEIGHTS).unlink()  # someone tampered with the cache
    again = cache.fetch_record("acme", a)
    assert not again.hit and again.path == path and (path / WEIGHTS).is_file()
