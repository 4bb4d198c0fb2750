"""What /ready checks: the model is loaded, the engine runs, no drain is on. It never waits on a store.

The adapter store and the config store are shared by every replica, so their trouble is not this
replica's: failing readiness for it would take the whole fleet out of the load balancer, while each
replica can still serve the base model, every adapter it holds, and the last known config. So their
health shows under `degraded` (and in the metrics) without failing the probe. The adapter store's
check lists or writes the backend (S3 included): it runs in the background at most every few seconds,
and a probe reads its last result, so a hung store cannot hang the probe.

This replica's adapter disk cache may also run out of room (its disk full of other files, or of adapters
in use): adapters it does not hold cannot be loaded here meanwhile, but everything else serves, so that
shows under `degraded` too (read from the cache's shared mark, in the same background check).

The body names no address, path or bucket: anyone who reaches the port may read it; the log has the
details.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from loraserve.services import Services

log = logging.getLogger(__name__)

STORE_CHECK_INTERVAL_S = 5.0
ADAPTER_STORE_DOWN = "adapter store unreachable: adapters not resident here cannot be loaded"
CONFIG_STORE_DOWN = "config store unreachable: serving the last known routes and keys"
WARMING_UP = "warming up: a few requests through the serving path (--no-serving-warmup skips it)"
ADAPTER_CACHE_FULL = (
    "adapter disk cache out of room: adapters not already on this replica's disk cannot be loaded until "
    "space is freed"
)


class ReadyStatus(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    ready: bool
    model: str
    reasons: list[str]  # why not ready; empty when ready
    degraded: list[str] = []  # shared stores in trouble: still ready, but some requests will fail


class Readiness:
    def __init__(self, interval_s: float = STORE_CHECK_INTERVAL_S, model: str = "") -> None:
        self._interval_s = interval_s
        self._checked_at = -float("inf")
        self._check: asyncio.Task[None] | None = None
        self.adapter_store_up = True  # the last background check's result
        self.adapter_cache_full = False  # likewise
        # Until the services exist (the model converting or loading), what /ready reports.
        self.model = model
        self.loading_step = "starting"
        self.warming_up = False  # the serving warm-up runs (ops/serving_warmup.py)

    def loading(self, step: str) -> None:
        """The server listens while it loads the model; /ready names the step it is at."""
        self.loading_step = step

    def not_loaded(self) -> ReadyStatus:
        return ReadyStatus(
            ready=False, model=self.model, reasons=[f"model not loaded yet: {self.loading_step}"]
        )

    async def check(self, services: Services) -> ReadyStatus:
        reasons = []
        if services.shutdown is not None and services.shutdown.draining:
            reasons.append("shutting down: not accepting new requests")
        if services.engine is None:
            reasons.append("model not loaded yet")
        elif (dead := engine_dead_reason(services)) is not None:
            reasons.append(dead)
        if self.warming_up:
            reasons.append(WARMING_UP)
        front_ends = services.front_ends
        if front_ends is not None and (waiting := front_ends.not_ready_reason()) is not None:
            reasons.append(waiting)  # one port, several processes: ready when every one serves
        self._start_store_check(services)
        degraded = []
        if not self.adapter_store_up:
            degraded.append(ADAPTER_STORE_DOWN)
        if self.adapter_cache_full:
            degraded.append(ADAPTER_CACHE_FULL)
        if not getattr(services.config_store, "healthy", True):
            degraded.append(CONFIG_STORE_DOWN)
        return ReadyStatus(
            ready=not reasons, model=services.base_model_id, reasons=reasons, degraded=degraded
        )

    def close(self) -> None:
        """Stop a store check still waiting (its worker thread ends with the store call's own timeout)."""
        if self._check is not None:
            self._check.cancel()

    def _start_store_check(self, services: Services) -> None:
        now = time.monotonic()
        if (self._check is not None and not self._check.done()) or now - self._checked_at < self._interval_s:
            return
        self._checked_at = now
        self._check = asyncio.create_task(self._check_adapter_store(services), name="adapter-store-check")

    async def _check_adapter_store(self, services: Services) -> None:
        cache = services.disk_cache
        try:  # a local read first: a hung store must not hold up this answer
            full = cache is not None and await asyncio.to_thread(cache.out_of_room)
        except Exception:  # the cache's mark unreadable: say nothing rather than guess
            full = False
        if full != self.adapter_cache_full:
            (log.warning if full else log.info)(
                "adapter disk cache %s", "out of room" if full else "has room again"
            )
        self.adapter_cache_full = full
        try:
            await asyncio.to_thread(services.adapter_store.check)
        except Exception as exc:  # StoreUnavailable, or anything else the backend raises
            if self.adapter_store_up:
                log.warning("adapter store check failed: %s", exc)
            self.adapter_store_up = False
        else:
            if not self.adapter_store_up:
                log.info("adapter store reachable again")
            self.adapter_store_up = True


def engine_dead_reason(services: Services | None) -> str | None:
    """Why the engine cannot serve any more (its core process died), or None (also before start-up).
    The same words for everyone: the cause (exit code, the core's last error) is in the server log."""
    error = getattr(services.engine, "dead_error", None) if services is not None else None
    if error is None:
        return None
    return "engine stopped on an internal error; restart the server (the log has details)"
