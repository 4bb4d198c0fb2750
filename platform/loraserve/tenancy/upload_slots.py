"""A per-tenant cap on concurrent adapter uploads (`--max-concurrent-uploads-per-tenant`), 429 beyond it.

Each upload holds up to one copy of the adapter on the staging disk while it streams in and is checked,
and a worker thread while it is stored; without a cap one tenant could fill the disk or the thread pool
with parallel uploads for everyone. Uploads are rare and short, so the cap is small and Retry-After fixed.
Everything runs on the event loop: check-and-increment has no await in between.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraserve.tenancy.errors import TooManyRequests

DEFAULT_MAX_UPLOADS = 2
RETRY_AFTER_S = 5


class UploadSlots:
    def __init__(self, max_per_tenant: int = DEFAULT_MAX_UPLOADS) -> None:
        if isinstance(max_per_tenant, bool) or not isinstance(max_per_tenant, int) or max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be a positive integer (got {max_per_tenant!r})")
        self.max_per_tenant = max_per_tenant
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    @asynccontextmanager
    async def acquire(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the tenant's upload slots for the block; TooManyRequests if none is free."""
        running = self._in_flight.get(tenant, 0)
        if running >= self.max_per_tenant:
            raise TooManyRequests(
                f"tenant {tenant!r} already has {running} adapter uploads in progress, the most allowed at once; "
                f"retry when one has finished (the limit is --max-concurrent-uploads-per-tenant)",
                retry_after_s=RETRY_AFTER_S,
            )
        self._in_flight[tenant] = running + 1
        try:
            yield
        finally:
            left = self._in_flight[tenant] - 1
            if left:
                self._in_flight[tenant] = left
            else:
                del self._in_flight[tenant]
