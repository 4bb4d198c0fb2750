"""Per-tenant write locks that hold across the front-end processes of one server.

The embedded config store makes a route write and an adapter deletion of one tenant exclude each other
with a lock per tenant (config_store/base.py: the route quota and "no route names a deleted version"
rest on it). That lock is an asyncio.Lock, which one process sees; with several front-end processes on
one store folder, two of them could each pass their check and both write. So a front end's lock also
takes a file lock (`fcntl.flock`) on a file per tenant in the server's runtime folder: the in-process
lock queues this process's writers, the file lock the processes. The kernel drops a dead holder's file
lock, and a waiter gives up after WAIT_S with ConfigStoreUnavailable (503) rather than hang a request.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
from pathlib import Path

from loraserve.config_store.errors import ConfigStoreUnavailable

WAIT_S = 30.0
_POLL_S = 0.005


class SharedTenantLock:
    """`async with lock:` holds the tenant's lock in this process and in every other front end."""

    def __init__(self, path: Path, local: asyncio.Lock) -> None:
        self._path = path
        self._local = local
        self._fd: int | None = None

    async def __aenter__(self) -> SharedTenantLock:
        await self._local.acquire()
        try:
            self._fd = await self._lock_file()
        except BaseException:
            self._local.release()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            self._local.release()

    async def _lock_file(self) -> int:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    if loop.time() > deadline:
                        raise ConfigStoreUnavailable(
                            "another front-end process held this tenant's route lock too long; retry"
                        ) from None
                    await asyncio.sleep(_POLL_S)
        except BaseException:
            os.close(fd)
            raise


class SharedTenantLocks:
    """The locks of one server's front ends: a file per tenant under `folder` (named by a hash, so no
    tenant name becomes a path)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._local: dict[str, asyncio.Lock] = {}

    def __call__(self, tenant: str) -> SharedTenantLock:
        name = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        local = self._local.setdefault(tenant, asyncio.Lock())
        return SharedTenantLock(self._folder / name, local)
