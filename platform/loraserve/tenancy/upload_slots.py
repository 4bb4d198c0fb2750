"""A per-tenant cap on concurrent adapter uploads (`--max-concurrent-uploads-per-tenant`), 429 beyond it.

Each upload holds up to one copy of the adapter on the staging disk while it streams in and is checked,
and a worker thread while it is stored; without a cap one tenant could fill the disk or the thread pool
with parallel uploads for everyone. Uploads are rare and short, so the cap is small and Retry-After fixed.
The counts live in a TenantTable (tenancy.tenant_table), so with several front-end processes the cap
holds for the replica, whichever process an upload lands on; check-and-increment happen under one hold
of the table's lock.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraserve.tenancy.errors import TooManyRequests
from loraserve.tenancy.tenant_table import TenantTable

DEFAULT_MAX_UPLOADS = 2
RETRY_AFTER_S = 5


class UploadSlots:
    def __init__(
        self, max_per_tenant: int = DEFAULT_MAX_UPLOADS, *, table: TenantTable | None = None
    ) -> None:
        if isinstance(max_per_tenant, bool) or not isinstance(max_per_tenant, int) or max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be a positive integer (got {max_per_tenant!r})")
        self.max_per_tenant = max_per_tenant
        self.table = table if table is not None else TenantTable.in_process()

    def in_flight(self, tenant: str) -> int:
        with self.table.locked() as table:
            return table.uploads(table.row(tenant, now=time.monotonic(), create=False))

    @asynccontextmanager
    async def acquire(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the tenant's upload slots for the block; TooManyRequests if none is free."""
        with self.table.locked() as table:
            row = table.row(tenant, now=time.monotonic())
            running = table.uploads(row)
            if running >= self.max_per_tenant:
                raise TooManyRequests(
                    f"tenant {tenant!r} already has {running} adapter uploads in progress, the most allowed at "
                    f"once; retry when one has finished (the limit is --max-concurrent-uploads-per-tenant)",
                    retry_after_s=RETRY_AFTER_S,
                )
            table.add_uploads(row, 1)
        try:
            yield
        finally:
            with self.table.locked() as table:
                table.add_uploads(table.row(tenant, now=time.monotonic()), -1)
