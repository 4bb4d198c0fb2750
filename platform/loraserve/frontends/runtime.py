"""The folder the processes of one multi-process server share, and what lies in it.

The supervisor makes it at start (under /dev/shm where it exists, so it is memory) and removes it at
the end; every front-end process maps the files it needs:

    limits      the tenant table (loraserve.tenancy.tenant_table): concurrency and token counters
    status      one byte per front-end process: starting, ready, stopping (for /ready)
    metrics/    prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR)
    locks/      per-tenant route-write locks (loraserve.frontends.tenant_locks)
    events-*    ipc:// addresses of the config-event hub (loraserve.frontends.peer_events)
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loraserve.tenancy.tenant_table import TenantTable

STARTING, READY, STOPPING = 0, 1, 2


@dataclass(frozen=True)
class Runtime:
    folder: Path
    num_front_ends: int

    @classmethod
    def create(cls, num_front_ends: int) -> Runtime:
        shm = Path("/dev/shm")
        parent = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
        runtime = cls(Path(tempfile.mkdtemp(prefix="loraserve-", dir=parent)), num_front_ends)
        try:
            TenantTable.create(runtime.limits_path, num_front_ends)
            runtime.status_path.write_bytes(bytes(num_front_ends))
            runtime.metrics_dir.mkdir()
            runtime.locks_dir.mkdir()
        except BaseException:  # /dev/shm full, say: leave nothing half-made behind
            runtime.remove()
            raise
        return runtime

    @property
    def limits_path(self) -> Path:
        return self.folder / "limits"

    @property
    def status_path(self) -> Path:
        return self.folder / "status"

    @property
    def metrics_dir(self) -> Path:
        return self.folder / "metrics"

    @property
    def locks_dir(self) -> Path:
        return self.folder / "locks"

    @property
    def events_in(self) -> str:
        return f"ipc://{self.folder}/events-in"

    @property
    def events_out(self) -> str:
        return f"ipc://{self.folder}/events-out"

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class FrontEndStatus:
    """One byte per front-end process in the shared `status` file."""

    def __init__(self, path: Path) -> None:
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)

    def set(self, slot: int, state: int) -> None:
        self._map[slot] = state

    def get(self, slot: int) -> int:
        return self._map[slot]

    def not_ready(self) -> list[int]:
        """The slots of front-end processes that are not serving yet (or any more)."""
        return [slot for slot, state in enumerate(self._map[:]) if state != READY]

    def close(self) -> None:
        self._map.close()
