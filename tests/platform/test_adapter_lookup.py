"""AdapterLookup against a scripted store: TTL, resident adapters never wait on the store, stale-if-error,
timeouts on a hung store, fail-fast after a failure, and invalidation by config events."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest
from loraserve.adapter_lookup import STORE_UNAVAILABLE, AdapterLookup
from loraserve.config_store import ConfigEvent

from adapters_store import AdapterNotFound, AdapterRecord, StoreUnavailable


def record(name: str, version: int) -> AdapterRecord:
    return AdapterRecord(
        name=name,
        version=version,
        rank=4,
        alpha=8.0,
        target_modules=("q_proj",),
        base_model=None,
        sha256="0" * 64,
        size_bytes=1,
        created_at="2026-01-01T00:00:00Z",
    )


class ScriptedStore:
    """`get` answers from `latest` (name -> version), or fails, or hangs until released."""

    def __init__(self) -> None:
        self.latest = {("t", "a"): 1, ("u", "a"): 1}  # (tenant, name) -> latest version
        self.mode = "ok"  # ok | refuse | hang
        self.calls = Counter()
        self.release = threading.Event()

    def get(self, tenant, name, version=None):
        self.calls[(tenant, name, version)] += 1
        if self.mode == "refuse":
            raise StoreUnavailable("list s3://bucket at http://10.0.0.1:9000 failed: connection refused")
        if self.mode == "hang":
            self.release.wait(10)
            raise StoreUnavailable("read timed out")
        if (tenant, name) not in self.latest:
            raise AdapterNotFound(f"no adapter named {name!r}")
        return record(name, version or self.latest[tenant, name])


@pytest.fixture
def store():
    store = ScriptedStore()
    yield store
    store.release.set()  # no thread of the lookup pool outlives the test


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_lookup(clock: Clock, **options) -> AdapterLookup:
    return AdapterLookup(ttl_s=30.0, timeout_s=0.3, retry_s=2.0, clock=clock, **options)


def resident(*ids: str):
    return lambda tenant, rec: f"{tenant}/{rec.ref}" in ids


def run(coro):
    return asyncio.run(coro)


def test_answers_are_kept_for_the_ttl_then_asked_again(store):
    clock = Clock()
    lookup = make_lookup(clock)
    assert run(lookup.resolve(store, "t", "a")).version == 1
    store.latest["t", "a"] = 2  # uploaded through another replica, its event lost
    clock.now = 29.0
    assert run(lookup.resolve(store, "t", "a")).version == 1
    assert store.calls[("t", "a", None)] == 1
    clock.now = 31.0
    assert run(lookup.resolve(store, "t", "a")).version == 2
    with pytest.raises(AdapterNotFound):
        run(lookup.resolve(store, "t", "missing"))
    with pytest.raises(AdapterNotFound):  # not-found answers are cached too
        run(lookup.resolve(store, "t", "missing"))
    assert store.calls[("t", "missing", None)] == 1
    lookup.close()


@pytest.mark.parametrize("mode", ["refuse", "hang"])
def test_a_resident_adapter_never_waits_on_the_store(store, mode):
    clock = Clock()
    lookup = make_lookup(clock)
    run(lookup.resolve(store, "t", "a"))
    store.mode = mode
    clock.now = 100.0  # long past the TTL

    async def burst():
        started = time.monotonic()
        records = [await lookup.resolve(store, "t", "a", resident("t/a@1")) for _ in range(20)]
        return records, time.monotonic() - started

    records, waited = run(burst())
    assert {r.ref for r in records} == {"a@1"}
    assert waited < 0.1  # the refresh runs in the background
    assert store.calls[("t", "a", None)] <= 2  # one background refresh (shared), not one per request
    lookup.close()


def test_a_failing_store_serves_known_answers_and_refuses_unknown_ones_at_once(store):
    clock = Clock()
    lookup = make_lookup(clock)
    run(lookup.resolve(store, "t", "a"))
    store.mode = "refuse"
    clock.now = 100.0
    assert run(lookup.resolve(store, "t", "a")).version == 1  # stale-if-error
    with pytest.raises(StoreUnavailable) as caught:
        run(lookup.resolve(store, "t", "b"))
    assert str(caught.value) == STORE_UNAVAILABLE  # no endpoint, no bucket
    calls = sum(store.calls.values())
    for _ in range(5):  # within retry_s the store is left alone
        with pytest.raises(StoreUnavailable):
            run(lookup.resolve(store, "t", "c"))
        assert run(lookup.resolve(store, "t", "a")).version == 1
    assert sum(store.calls.values()) == calls
    store.mode = "ok"
    store.latest["t", "b"] = 1
    clock.now = 103.0  # retry_s later the store is asked again, and it is back
    assert run(lookup.resolve(store, "t", "b")).version == 1
    assert run(lookup.resolve(store, "t", "a")).version == 1
    assert lookup.num_stale_served == 6
    lookup.close()


def test_a_hung_store_costs_at_most_the_timeout(store):
    clock = Clock()
    lookup = make_lookup(clock)
    run(lookup.resolve(store, "t", "a"))
    store.mode = "hang"
    clock.now = 100.0

    async def timed(ref):
        started = time.monotonic()
        try:
            return (await lookup.resolve(store, "t", ref)).ref, time.monotonic() - started
        except StoreUnavailable as exc:
            return str(exc), time.monotonic() - started

    assert run(timed("never-seen")) == (STORE_UNAVAILABLE, pytest.approx(0.3, abs=0.2))
    answer, waited = run(timed("a"))  # store marked down by the timeout: the known answer at once
    assert answer == "a@1" and waited < 0.1
    lookup.close()


def test_config_events_invalidate_at_once(store):
    clock = Clock()
    lookup = make_lookup(clock)
    run(lookup.resolve(store, "t", "a"))
    run(lookup.resolve(store, "t", "a@1"))
    run(lookup.resolve(store, "u", "a"))
    store.latest["t", "a"] = 2
    lookup.on_config_event(ConfigEvent(kind="adapter", op="put", tenant="t", name="a"))
    assert run(lookup.resolve(store, "t", "a")).version == 2
    assert run(lookup.resolve(store, "u", "a")).version == 1  # another tenant's name: untouched
    assert store.calls[("u", "a", None)] == 1

    del store.latest["t", "a"]
    lookup.on_config_event(ConfigEvent(kind="adapter", op="delete", tenant="t", name="a"))
    store.mode = "refuse"  # a deleted adapter is never served from the cache, even with the store down
    with pytest.raises(StoreUnavailable):
        run(lookup.resolve(store, "t", "a@1"))
    store.mode = "ok"
    clock.now = 10.0
    with pytest.raises(AdapterNotFound):
        run(lookup.resolve(store, "t", "a@1"))

    lookup.on_config_event(ConfigEvent(kind="resync"))  # events may have been missed: ask again
    run(lookup.resolve(store, "u", "a"))
    assert store.calls[("u", "a", None)] == 2
    lookup.close()


def test_an_invalidated_resident_adapter_is_refreshed_before_use(store):
    """An upload event means `a` may name a new version: even a resident `a@1` must not answer for it."""
    clock = Clock()
    lookup = make_lookup(clock)
    run(lookup.resolve(store, "t", "a", resident("t/a@1")))
    store.latest["t", "a"] = 2
    lookup.invalidate("t", "a")
    assert run(lookup.resolve(store, "t", "a", resident("t/a@1"))).version == 2
    lookup.close()


def test_call_bounds_other_store_reads(store):
    lookup = make_lookup(Clock())
    hung = threading.Event()
    with pytest.raises(StoreUnavailable, match="unavailable"):
        run(lookup.call(hung.wait, 10))
    with pytest.raises(StoreUnavailable):  # marked down: the next call does not even start
        run(lookup.call(lambda: "listed"))
    hung.set()
    lookup.close()
