"""The disk cache's eviction without a scan per insertion: an exact LRU across processes sharing one
directory, the byte total kept in a file (never low, corrected by scans), pins never evicted.

Several DiskCache instances on one directory stand for several processes (flock separates open
descriptors, not processes); each keeps its own list of eviction candidates."""

from __future__ import annotations

import fcntl
import os
import random
from collections import OrderedDict

import pytest

import adapters_store.cache as cache_module
from adapters_store import CountingMetrics, DiskCache, StoreConfig, open_store
from adapters_store.cache_usage import USAGE_FILE, ByteTotal

WEIGHTS = "adapter_model.safetensors"
NAMES = [f"n{i:02d}" for i in range(8)]  # one length: every entry (files and manifest) has one size


@pytest.fixture
def local_store(tmp_path, model_shape):
    return open_store(StoreConfig(url=f"file://{tmp_path}/store"), model_shape, CountingMetrics())


@pytest.fixture
def stored(local_store, adapter_dir, files_of, tmp_path):
    """Records of NAMES (one weight file each) and the bytes one entry takes in the cache."""
    records = {name: local_store.put("acme", name, files_of(adapter_dir)) for name in NAMES}
    probe = DiskCache(local_store, tmp_path / "probe", 1 << 30)
    sizes = {
        sum(f.stat().st_size for f in probe.fetch_record("acme", r).path.iterdir()) for r in records.values()
    }
    assert len(sizes) == 1
    return records, sizes.pop()


@pytest.fixture
def scans(monkeypatch):
    """Counts full scans of the cache directory."""
    calls = []
    real = cache_module.scan_cache

    def counting(directory):
        calls.append(directory)
        return real(directory)

    monkeypatch.setattr(cache_module, "scan_cache", counting)
    return calls


def make_cache(store, tmp_path, max_bytes):
    return DiskCache(store, tmp_path / "cache", max_bytes, CountingMetrics())


def cached_names(tmp_path) -> set[str]:
    tenant = tmp_path / "cache/acme"
    return {p.name for p in tenant.iterdir() if any(p.iterdir())} if tenant.exists() else set()


def disk_bytes(tmp_path) -> int:
    """What the cache holds, counted without it."""
    return sum(f.stat().st_size for f in (tmp_path / "cache/acme").glob("*/*/*"))


def stored_total(tmp_path) -> int | None:
    return ByteTotal(tmp_path / "cache").read()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_caches_sharing_a_directory_evict_exactly_as_one_lru(local_store, stored, tmp_path, seed):
    """Random fetches, discards and restarts through three instances, checked against a plain LRU model
    after every step: same hits, same entries, never over budget, and the stored total exact."""
    records, entry_bytes = stored
    budget = 3
    caches = [make_cache(local_store, tmp_path, budget * entry_bytes) for _ in range(3)]
    model: OrderedDict[str, None] = OrderedDict()  # least recently used first
    rng = random.Random(seed)
    for step in range(120):
        i, name = rng.randrange(3), rng.choice(NAMES[: rng.choice([4, 8])])  # a hot half, a cold half
        op = rng.random()
        if op < 0.08:
            caches[i].discard("acme", name)
            model.pop(name, None)
        elif op < 0.12:
            caches[i] = make_cache(local_store, tmp_path, budget * entry_bytes)  # a process restarts
        else:
            hit = caches[i].fetch_record("acme", records[name]).hit
            assert hit == (name in model), f"step {step}: {name}"
            model[name] = None
            model.move_to_end(name)
            while len(model) > budget:
                model.popitem(last=False)
        assert cached_names(tmp_path) == set(model), f"step {step}"
        exact = caches[0].total_bytes
        assert exact == len(model) * entry_bytes <= budget * entry_bytes
        assert stored_total(tmp_path) in (None, exact)  # None only before the first insertion


def test_insertions_within_budget_scan_nothing(local_store, stored, tmp_path, scans):
    records, entry_bytes = stored
    cache = make_cache(local_store, tmp_path, 100 * entry_bytes)
    scans.clear()  # the start-up scan
    for record in records.values():
        assert not cache.fetch_record("acme", record).hit
    assert len(scans) == 1  # the first insertion learns the total; the others add to it
    assert stored_total(tmp_path) == len(NAMES) * entry_bytes


def test_a_full_cache_scans_once_per_list_of_candidates_not_per_insertion(
    local_store, stored, tmp_path, scans
):
    records, entry_bytes = stored
    cache = make_cache(local_store, tmp_path, 4 * entry_bytes)
    scans.clear()
    for step in range(40):  # every fetch a miss that evicts one entry
        assert not cache.fetch_record("acme", records[NAMES[step % len(NAMES)]]).hit
        assert disk_bytes(tmp_path) == min(step + 1, 4) * entry_bytes
    assert len(scans) <= 40 // 4 + 1  # one scan lists the 5 entries then on disk: 4 evictions at least


def test_a_pinned_entry_is_never_evicted_and_goes_first_once_released(local_store, stored, tmp_path):
    records, entry_bytes = stored
    holder = make_cache(local_store, tmp_path, 2 * entry_bytes)
    churner = make_cache(local_store, tmp_path, 2 * entry_bytes)
    oldest = records[NAMES[0]]
    with holder.checkout("acme", oldest) as pinned:
        weights = (pinned.path / WEIGHTS).read_bytes()
        for name in NAMES[1:]:
            churner.fetch_record("acme", records[name])
            assert (pinned.path / WEIGHTS).read_bytes() == weights
            assert churner.total_bytes == 2 * entry_bytes
        assert cached_names(tmp_path) == {NAMES[0], NAMES[-1]}  # the pin counts in the budget
    churner.fetch_record("acme", records[NAMES[1]])  # the released entry is the oldest: it goes first
    assert cached_names(tmp_path) == {NAMES[-1], NAMES[1]}
    assert stored_total(tmp_path) == churner.total_bytes == 2 * entry_bytes


def test_a_crash_between_counting_and_renaming_errs_high_then_a_scan_corrects_it(
    local_store, stored, tmp_path, monkeypatch
):
    records, entry_bytes = stored
    cache = make_cache(local_store, tmp_path, 2 * entry_bytes)
    cache.fetch_record("acme", records[NAMES[0]])
    real_rename = os.rename

    def crash(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise OSError("killed")  # as if the process died after counting, before its rename
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="killed"):
        cache.fetch_record("acme", records[NAMES[1]])
    monkeypatch.setattr(os, "rename", real_rename)
    assert cached_names(tmp_path) == {NAMES[0]}
    assert stored_total(tmp_path) == 2 * entry_bytes  # high: counts a folder that never landed
    cache.fetch_record("acme", records[NAMES[2]])  # "3 entries": evicts the oldest early, never overruns
    assert cache.total_bytes == entry_bytes <= stored_total(tmp_path)
    make_cache(local_store, tmp_path, 2 * entry_bytes)  # a start scans and writes the exact total
    assert stored_total(tmp_path) == entry_bytes


@pytest.mark.parametrize("damage", ["missing", "torn", "negative"])
def test_an_unknown_total_is_counted_again_by_the_next_insertion(local_store, stored, tmp_path, damage):
    records, entry_bytes = stored
    cache = make_cache(local_store, tmp_path, 2 * entry_bytes)
    cache.fetch_record("acme", records[NAMES[0]])
    cache.fetch_record("acme", records[NAMES[1]])
    usage = tmp_path / "cache" / USAGE_FILE
    if damage == "missing":
        usage.unlink()
    elif damage == "torn":
        usage.write_bytes(b"00000")
    else:
        ByteTotal(tmp_path / "cache").write(-5)
    assert stored_total(tmp_path) is None
    cache.fetch_record("acme", records[NAMES[2]])  # a low total would leave three entries here
    assert cached_names(tmp_path) == {NAMES[1], NAMES[2]}
    assert stored_total(tmp_path) == 2 * entry_bytes


def test_discard_takes_its_bytes_off_the_total(local_store, stored, tmp_path):
    records, entry_bytes = stored
    cache = make_cache(local_store, tmp_path, 10 * entry_bytes)
    for name in NAMES[:3]:
        cache.fetch_record("acme", records[name])
    assert cache.discard("acme", NAMES[1]) == 1
    assert stored_total(tmp_path) == cache.total_bytes == 2 * entry_bytes


def test_a_candidate_skipped_while_pinned_stays_first_in_line(local_store, stored, tmp_path):
    records, entry_bytes = stored
    holder = make_cache(local_store, tmp_path, 5 * entry_bytes)
    for name in NAMES[:5]:
        holder.fetch_record("acme", records[name])
    churner = make_cache(local_store, tmp_path, 5 * entry_bytes)  # its start-up scan lists n00..n04
    for name in NAMES[:2]:
        holder.fetch_record("acme", records[name])  # hits: n00 and n01 become the newest
    # Oldest first: n02, n03, n04, n00, n01. Pin n02 as a checkout does (a shared lock on its folder).
    pin = os.open(tmp_path / f"cache/acme/{NAMES[2]}/1-{records[NAMES[2]].sha256}", os.O_RDONLY)
    try:
        fcntl.flock(pin, fcntl.LOCK_SH)
        churner.fetch_record("acme", records[NAMES[5]])  # n02 is pinned: n03 goes
        assert cached_names(tmp_path) == set(NAMES[:6]) - {NAMES[3]}
    finally:
        os.close(pin)
    churner.fetch_record("acme", records[NAMES[6]])  # released, n02 is the oldest again (not n04)
    assert cached_names(tmp_path) == {NAMES[0], NAMES[1], NAMES[4], NAMES[5], NAMES[6]}
