"""Per-tenant cap on concurrent requests, so one tenant cannot take every engine slot.

The limit applies to the tenant's in-flight count; the number compared against it is the calling
key's `max_concurrent_requests`, else the server default (None: unlimited). Two keys of one tenant
with different limits therefore share one count but each stops at its own limit.

Retry-After is an estimate, not a promise: with L slots and requests lasting D seconds on average
(an exponentially weighted mean of this tenant's recent leases), one slot frees about every D / L
seconds. The hint is that, rounded up to whole seconds and clamped to [min, max].

The counts live in a TenantTable (tenancy.tenant_table): this process's own, or the table every
front-end process of the replica shares, so the cap holds per replica whatever process a request lands
on. Check-and-increment happen under one hold of the table's lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraserve.tenancy.errors import TooManyRequests
from loraserve.tenancy.principal import Principal
from loraserve.tenancy.tenant_table import TenantTable

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
        table: TenantTable | None = None,
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
        self.table = table if table is not None else TenantTable.in_process()

    def limit_for(self, principal: Principal) -> int | None:
        return principal.max_concurrent or self.default_max_concurrent

    def in_flight(self, tenant: str) -> int:
        with self.table.locked() as table:
            return table.in_flight(table.row(tenant, now=time.monotonic(), create=False))

    def try_acquire(self, principal: Principal) -> Lease:
        """Admit now or raise TooManyRequests; the caller must `release()` the lease (for streams)."""
        tenant = principal.tenant
        limit = self.limit_for(principal)
        with self.table.locked() as table:
            row = table.row(tenant, now=time.monotonic())
            running = table.in_flight(row)
            if limit is not None and running >= limit:
                retry = self._retry_after_s(table.mean_duration_s(row), limit)
                raise TooManyRequests(
                    f"tenant {tenant!r} already has {running} requests running, its limit is {limit}; "
                    f"retry in {retry} s or ask the operator for a higher max_concurrent_requests",
                    retry_after_s=retry,
                )
            table.add_in_flight(row, 1)
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
        with self.table.locked() as table:
            row = table.row(tenant, now=time.monotonic(), create=False)
            return self._retry_after_s(table.mean_duration_s(row), limit)

    def _retry_after_s(self, mean: float | None, limit: int) -> int:
        if mean is None:
            return self._min_retry
        return max(self._min_retry, min(self._max_retry, math.ceil(mean / limit)))

    def _release(self, tenant: str, duration_s: float) -> None:
        with self.table.locked() as table:
            row = table.row(tenant, now=time.monotonic())
            table.add_in_flight(row, -1)
            previous = table.mean_duration_s(row)
            table.set_mean_duration_s(
                row,
                duration_s if previous is None else (1 - _EWMA_WEIGHT) * previous + _EWMA_WEIGHT * duration_s,
            )
