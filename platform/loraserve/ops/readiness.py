"""What /ready checks: the model is loaded, the adapter store and config store answer, no drain is on.

The adapter store check lists or writes the backend (S3 included), so its result is reused for a few
seconds: probes every second from several load balancers must not become a request storm on S3.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from loraserve.services import Services

STORE_CHECK_TTL_S = 5.0


class ReadyStatus(msgspec.Struct, frozen=True, kw_only=True):
    ready: bool
    model: str
    reasons: list[str]  # empty when ready


class Readiness:
    def __init__(self, ttl_s: float = STORE_CHECK_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._store_checked_at = -float("inf")
        self._store_error: str | None = None

    async def check(self, services: Services) -> ReadyStatus:
        reasons = []
        if services.shutdown is not None and services.shutdown.draining:
            reasons.append("shutting down: not accepting new requests")
        if services.engine is None:
            reasons.append("model not loaded yet")
        elif (dead := engine_dead_reason(services)) is not None:
            reasons.append(dead)
        store_error = await self._adapter_store_error(services)
        if store_error:
            reasons.append(f"adapter store unreachable: {store_error}")
        config_error = await _config_store_error(services)
        if config_error:
            reasons.append(f"config store unhealthy: {config_error}")
        return ReadyStatus(ready=not reasons, model=services.base_model_id, reasons=reasons)

    async def _adapter_store_error(self, services: Services) -> str | None:
        now = time.monotonic()
        if now - self._store_checked_at >= self._ttl_s:
            try:
                await asyncio.to_thread(services.adapter_store.check)
                self._store_error = None
            except Exception as exc:  # StoreUnavailable, or anything else the backend raises
                self._store_error = str(exc) or type(exc).__name__
            self._store_checked_at = now
        return self._store_error


def engine_dead_reason(services: Services | None) -> str | None:
    """Why the engine cannot serve any more (its core process died), or None (also before start-up)."""
    error = getattr(services.engine, "dead_error", None) if services is not None else None
    return None if error is None else f"engine stopped: {error}"


async def _config_store_error(services: Services) -> str | None:
    store = services.config_store
    healthy = getattr(store, "healthy", None)
    if healthy is not None:  # CachedConfigStore tracks its backend; no extra round trip per probe
        return None if healthy else (getattr(store, "last_error", None) or "unreachable")
    try:
        await store.ping()
    except Exception as exc:
        return str(exc) or type(exc).__name__
    return None
