"""Metrics hooks: the store and the disk cache call these; the platform maps them onto Prometheus.

`StoreMetrics` does nothing; subclass it (or use `CountingMetrics`) to record. Hooks run on the
calling thread and must be cheap and never raise.
"""

from __future__ import annotations

import threading


class StoreMetrics:
    """No-op hooks."""

    def cache_hit(self) -> None:
        """fetch() served from the disk cache."""

    def cache_miss(self) -> None:
        """fetch() had to download from the store."""

    def cache_eviction(self, num_bytes: int) -> None:
        """The disk cache removed one adapter version to stay under its byte budget."""

    def fetch_seconds(self, seconds: float) -> None:
        """One download from the store, checksum included."""

    def retry(self, operation: str, reason: str) -> None:
        """One backend call failed and is being retried."""


class CountingMetrics(StoreMetrics):
    """Thread-safe counters; enough for tests, logs and a /metrics bridge that polls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        self.evicted_bytes = 0
        self.num_fetches = 0
        self.total_fetch_seconds = 0.0
        self.num_retries = 0
        self.retry_reasons: list[str] = []

    def cache_hit(self) -> None:
        with self._lock:
            self.num_hits += 1

    def cache_miss(self) -> None:
        with self._lock:
            self.num_misses += 1

    def cache_eviction(self, num_bytes: int) -> None:
        with self._lock:
            self.num_evictions += 1
            self.evicted_bytes += num_bytes

    def fetch_seconds(self, seconds: float) -> None:
        with self._lock:
            self.num_fetches += 1
            self.total_fetch_seconds += seconds

    def retry(self, operation: str, reason: str) -> None:
        with self._lock:
            self.num_retries += 1
            if len(self.retry_reasons) < 100:  # a bounded sample, for messages and tests
                self.retry_reasons.append(f"{operation}: {reason}")


class RecordingMetrics(StoreMetrics):
    """Appends each hook call to `calls` as (hook name, args): a loader process records what its store and
    disk cache saw, and the serving process replays the calls onto its own metrics (`replay_metrics`)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def cache_hit(self) -> None:
        self.calls.append(("cache_hit", ()))

    def cache_miss(self) -> None:
        self.calls.append(("cache_miss", ()))

    def cache_eviction(self, num_bytes: int) -> None:
        self.calls.append(("cache_eviction", (num_bytes,)))

    def fetch_seconds(self, seconds: float) -> None:
        self.calls.append(("fetch_seconds", (seconds,)))

    def retry(self, operation: str, reason: str) -> None:
        self.calls.append(("retry", (operation, reason)))


_HOOKS = frozenset(name for name in vars(StoreMetrics) if not name.startswith("_"))  # the hooks, nothing else


def replay_metrics(hook: str, args: tuple, store_metrics: StoreMetrics, cache_metrics: StoreMetrics) -> None:
    """One recorded call onto the serving process's metrics: the cache's hooks, or the store's."""
    if hook not in _HOOKS:
        raise ValueError(f"unknown metrics hook {hook!r}")
    target = cache_metrics if hook.startswith("cache_") else store_metrics
    getattr(target, hook)(*args)
