"""Per-tenant cap on concurrent requests, so one tenant cannot take every engine slot.

The limit applies to the tenant's in-flight count; the number compared against it is the calling
key's `max_concurrent_requests`, else the server default (None: unlimited). Two keys of one tenant
with different limits therefore share one count but each stops at its own limit.

Retry-After is an estimate, not a promise: with L slots and requests lasting D seconds on average
(an exponentially weighted mean of this tenant's recent leases), one slot frees about every D / L
seconds. The hint is that, rounded up to whole seconds and clamped to [min, max].

Everything runs on one event loop; check-and-increment has no await in between, so no lock is needed.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraserve.tenancy.errors import TooManyRequests
from loraserve.tenancy.principal import Principal

_EWMA_WEIGHT = 0.2  # weight of the newest lease duration in the running mean


class Lease:
    """One admitted request. `release()` is idempotent, so streaming code may call it from several exits."""

    def __init__(self, limiter: ConcurrencyLimiter, tenant: str) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self._started = time.monotonic()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self.tenant, time.monotonic() - self._started)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class ConcurrencyLimiter:
    def __init__(
        self,
        default_max_concurrent: int | None = None,
        *,
        min_retry_after_s: int = 1,
        max_retry_after_s: int = 60,
    ) -> None:
        if default_max_concurrent is not None and default_max_concurrent < 1:
            raise ValueError(
                f"default_max_concurrent must be a positive integer or None, got {default_max_concurrent}"
            )
        if not 1 <= min_retry_after_s <= max_retry_after_s:
            raise ValueError("need 1 <= min_retry_after_s <= max_retry_after_s")
        self.default_max_concurrent = default_max_concurrent
        self._min_retry = min_retry_after_s
        self._max_retry = max_retry_after_s
        self._in_flight: dict[str, int] = {}
        self._mean_duration_s: dict[str, float] = {}

    def limit_for(self, principal: Principal) -> int | None:
        return principal.max_concurrent or self.default_max_concurrent

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def try_acquire(self, principal: Principal) -> Lease:
        """Admit now or raise TooManyRequests; the caller must `release()` the lease (for streams)."""
        tenant = principal.tenant
        limit = self.limit_for(principal)
        running = self._in_flight.get(tenant, 0)
        if limit is not None and running >= limit:
            retry = self.retry_after_s(tenant, limit)
            raise TooManyRequests(
                f"tenant {tenant!r} already has {running} requests running, its limit is {limit}; "
                f"retry in {retry} s or ask the operator for a higher max_concurrent_requests",
                retry_after_s=retry,
            )
        self._in_flight[tenant] = running + 1
        return Lease(self, tenant)

    @asynccontextmanager
    async def acquire(self, principal: Principal) -> AsyncIterator[Lease]:
        """`async with limiter.acquire(p):` admits or raises, and releases on any exit."""
        lease = self.try_acquire(principal)
        try:
            yield lease
        finally:
            lease.release()

    def retry_after_s(self, tenant: str, limit: int) -> int:
        mean = self._mean_duration_s.get(tenant)
        if mean is None:
            return self._min_retry
        return max(self._min_retry, min(self._max_retry, math.ceil(mean / limit)))

    def _release(self, tenant: str, duration_s: float) -> None:
        running = self._in_flight.get(tenant, 0) - 1
        if running > 0:
            self._in_flight[tenant] = running
        else:
            self._in_flight.pop(tenant, None)
        previous = self._mean_duration_s.get(tenant)
        self._mean_duration_s[tenant] = (
            duration_s if previous is None else (1 - _EWMA_WEIGHT) * previous + _EWMA_WEIGHT * duration_s
        )
