"""What a cold adapter costs: seconds from the first request that missed the GPU to the adapter usable
there, and each request's time to first token, by the tier its adapter came from.

The tier is a label of bounded cardinality (never an adapter name): `SOURCE_TIERS`.

    gpu    warm: already in a GPU slot when the request arrived (TTFT only)
    kv     kept in idle KV-cache blocks after it lost its slot: one copy on the device (engine/lora/kv_tier.py)
    cpu    in the CPU tier: one host-to-device copy
    disk   in the local disk cache (or a registered local folder): read, validated, laid out, copied
    store  fetched from the adapter store (S3 or a store folder) first

One `ColdStart` per adapter and cold start, shared by every request that arrives while it lasts (they
share one load, engine/lora/manager.py). Its origin is known at once for the CPU tier, and from the
load's answer otherwise (a source says whether the disk cache held the adapter:
engine/lora/background_loads.RowReader). The manager observes the cold start when the adapter's copy
is complete; the engine observes each request's TTFT at its first token (engine/core/engine_metrics.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.stats import Histogram, HistogramCounts

SOURCE_TIERS = ("gpu", "kv", "cpu", "disk", "store")
# Seconds: from a millisecond (a slot copy) to a minute (a large adapter over a slow store).
ADAPTER_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0,
)  # fmt: skip


@dataclass(eq=False)
class ColdStart:
    """One adapter's way to the GPU, from the first request that missed it there."""

    origin: str | None = None  # "kv", "cpu", "disk" or "store" once known
    started: float = field(default_factory=time.monotonic)

    @property
    def tier(self) -> str:
        """The label: the origin, or "cpu" while no load reported one (its copy was in the CPU tier)."""
        return self.origin or "cpu"


class TierHistograms:
    """One histogram per source tier, created on first use (at most len(SOURCE_TIERS) of them)."""

    def __init__(self) -> None:
        self._histograms: dict[str, Histogram] = {}

    def observe(self, tier: str, seconds: float) -> None:
        if tier not in SOURCE_TIERS:
            raise ValueError(f"unknown source tier {tier!r}; one of {', '.join(SOURCE_TIERS)}")
        histogram = self._histograms.get(tier)
        if histogram is None:
            histogram = self._histograms[tier] = Histogram(ADAPTER_LATENCY_BUCKETS)
        histogram.observe(max(0.0, seconds))

    def snapshot(self) -> tuple[tuple[str, HistogramCounts], ...]:
        """(tier, counts) in SOURCE_TIERS order, for the tiers observed so far."""
        return tuple((t, self._histograms[t].snapshot()) for t in SOURCE_TIERS if t in self._histograms)
