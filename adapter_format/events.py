"""The adapter load events both the engine and the adapter store report, and the safe way to report them.

One vocabulary for the two sides: the engine's adapter manager reports GPU and CPU-tier lookups, copies
and evictions; the store's engine source reports disk-cache lookups and downloads; the server's metrics
turn both into Prometheus series.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

# observer(event, tier, seconds), called on the engine thread and, by sources, on worker threads (a loader
# process's events are replayed on the engine thread):
#   "hit"/"miss"  tier "gpu", "cpu": per request arrival, whether the adapter was already in that tier
#                 (a request that misses the GPU looks in the CPU tier); tier "disk": per store load
#                 (adapters_store.engine_source.StoreAdapterSource), whether the local disk cache held it.
#   "load"        seconds to bring an adapter from a tier: "source" (whole fetch + validation into the CPU
#                 tier), "cpu" (CPU tier -> GPU slot copy), "disk" (cached folder -> CPU tensors),
#                 "store" (download into the disk cache, checksum included).
#   "evict"       tier "gpu" (a slot reused for another adapter), "cpu" (CPU tier LRU).
#   "fail"        tier "source": a load failed (its requests fail with the reason).
Observer = Callable[[str, str, float], None]


def emit(observer: Observer | None, event: str, tier: str, seconds: float = 0.0) -> None:
    """Call an observer; a broken metrics hook is logged, never allowed to stop serving."""
    if observer is None:
        return
    try:
        observer(event, tier, seconds)
    except Exception:
        logger.exception("adapter observer failed on (%s, %s)", event, tier)
