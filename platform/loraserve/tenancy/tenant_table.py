"""Per-tenant counters of one replica, in memory that every front-end process of it shares.

The concurrency cap, the tokens per minute and the cap on parallel adapter uploads are limits per replica, whatever front-end process a
request lands on (`loraserve serve --api-server-count N`), so their counters live in one table: a file
mapped into every front-end process (under /dev/shm when it exists), one row per tenant, guarded by a
file lock (`fcntl.flock`, which the kernel releases if its holder dies, so a killed process never leaves
the others locked out). A check and its update happen under one lock hold, so two processes can never
both admit the last slot. One server process uses the same table in its own memory (`in_process`).

    row   name         in_flight[slot]    held[slot]    uploads[slot]   mean_s    window: 64 one-second buckets
    0     b"alice"     [2, 0, 1]          [96, 0, 32]   [0, 1, 0]       3.1       second | latest | tokens
    1     b"bob"       [0, 1, 0]          [0, 0, 0]     [0, 0, 0]       nan       ...

`in_flight`, `held` (what running requests may still generate) and `uploads` have a column per front-end
process
("slot"), written only by that process, so when one dies the supervisor clears its columns
(`clear_slot`) and its leases, holds and upload slots are not held forever. The window is shared: tokens used are
used, whoever counted them. A bucket holds the charges of one second of the clock, dated by its latest
charge, and leaves the window WINDOW_S after that: up to a second late, never early.

Rows are found by name (one vectorized comparison, cached per process); a full table reuses the row of a
tenant with nothing running, held or in its window. A table that is full of active tenants admits the
next new tenant without counting it and logs an error (capacity is thousands of active tenants).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

WINDOW_S = 60.0
NUM_BUCKETS = 64  # > WINDOW_S + 2 one-second buckets: a live bucket's ring place is never reused
SHARED_CAPACITY = 8192  # tenant rows in a shared table (about 1.5 KiB each)
_IN_PROCESS_ROWS = 64  # an in-process table starts here and doubles when full
NO_ROW = -1


def row_dtype(num_slots: int) -> np.dtype:
    return np.dtype(
        [
            (
                "name",
                "S64",
            ),  # tenant names are at most 64 ASCII characters (adapter_format/names.py); b"": free
            ("in_flight", "i8", (num_slots,)),
            ("held", "i8", (num_slots,)),
            ("uploads", "i8", (num_slots,)),  # adapter uploads in progress (tenancy.upload_slots)
            ("mean_s", "f8"),  # running mean of request durations; nan: none yet
            ("second", "i8", (NUM_BUCKETS,)),  # the clock's whole second a bucket counts
            ("at", "f8", (NUM_BUCKETS,)),  # its latest charge
            ("tokens", "i8", (NUM_BUCKETS,)),
        ]
    )


class TenantTable:
    """Rows of per-tenant counters (see the module docstring). Use every method under `locked()`."""

    def __init__(self, rows: np.ndarray, slot: int, lock_fd: int | None, *, growable: bool) -> None:
        self._rows = rows
        self.slot = slot  # this process's column in in_flight and held
        self._lock_fd = lock_fd
        self._thread_lock = threading.Lock()
        self._growable = growable
        self._cache: dict[str, int] = {}
        self._mmap: mmap.mmap | None = None

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def in_process(cls) -> TenantTable:
        """A table of this process alone (one server process)."""
        rows = np.zeros(_IN_PROCESS_ROWS, dtype=row_dtype(1))
        rows["mean_s"] = math.nan
        return cls(rows, 0, None, growable=True)

    @classmethod
    def create(cls, path: Path, num_slots: int, capacity: int = SHARED_CAPACITY) -> None:
        """Write an empty shared table for `num_slots` front-end processes (the supervisor, once)."""
        rows = np.zeros(capacity, dtype=row_dtype(num_slots))
        rows["mean_s"] = math.nan
        path.write_bytes(rows.tobytes())

    @classmethod
    def attach(cls, path: Path, num_slots: int, slot: int) -> TenantTable:
        """Map the shared table at `path` as front-end process `slot`."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        buffer = mmap.mmap(fd, size)
        dtype = row_dtype(num_slots)
        rows = np.frombuffer(buffer, dtype=dtype, count=size // dtype.itemsize)
        table = cls(rows, slot, fd, growable=False)
        table._mmap = buffer
        return table

    def close(self) -> None:
        self._rows = self._rows[:0]
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: the OS frees it at exit
                self._mmap.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- locking and rows -------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[TenantTable]:
        with self._thread_lock:
            if self._lock_fd is None:
                yield self
                return
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def row(self, tenant: str, *, now: float, create: bool = True) -> int:
        """The tenant's row (made if `create`), or NO_ROW."""
        key = tenant.encode()
        cached = self._cache.get(tenant, NO_ROW)
        if cached != NO_ROW and cached < len(self._rows) and self._rows["name"][cached] == key:
            return cached
        found = np.flatnonzero(self._rows["name"] == key)
        if found.size:
            self._cache[tenant] = int(found[0])
            return int(found[0])
        if not create:
            return NO_ROW
        row = self._free_row(now)
        if row == NO_ROW:
            log.error("the tenant table is full of active tenants: %r is admitted without limits", tenant)
            return NO_ROW
        self._rows[row] = 0
        self._rows["mean_s"][row] = math.nan
        self._rows["name"][row] = key
        self._cache[tenant] = row
        return row

    def _free_row(self, now: float) -> int:
        rows = self._rows
        free = np.flatnonzero(rows["name"] == b"")
        if free.size:
            return int(free[0])
        idle = (
            (rows["in_flight"].sum(axis=1) == 0)
            & (rows["held"].sum(axis=1) == 0)
            & (rows["uploads"].sum(axis=1) == 0)
            & ~(rows["at"] > now - WINDOW_S).any(axis=1)
        )
        candidates = np.flatnonzero(idle)
        if candidates.size:
            return int(candidates[0])
        if self._growable:
            start = len(rows)
            grown = np.zeros(2 * start, dtype=rows.dtype)
            grown[:start] = rows
            grown["mean_s"][start:] = math.nan
            self._rows = grown
            return start
        return NO_ROW

    def clear_slot(self, slot: int) -> None:
        """A front-end process died: its leases, holds and uploads end with it."""
        self._rows["in_flight"][:, slot] = 0
        self._rows["held"][:, slot] = 0
        self._rows["uploads"][:, slot] = 0

    # -- concurrency ------------------------------------------------------------------------------

    def in_flight(self, row: int) -> int:
        return int(self._rows["in_flight"][row].sum()) if row != NO_ROW else 0

    def add_in_flight(self, row: int, delta: int) -> None:
        if row != NO_ROW:
            column = self._rows["in_flight"][row]
            column[self.slot] = max(0, int(column[self.slot]) + delta)

    def mean_duration_s(self, row: int) -> float | None:
        value = float(self._rows["mean_s"][row]) if row != NO_ROW else math.nan
        return None if math.isnan(value) else value

    def set_mean_duration_s(self, row: int, value: float) -> None:
        if row != NO_ROW:
            self._rows["mean_s"][row] = value

    # -- uploads ----------------------------------------------------------------------------------

    def uploads(self, row: int) -> int:
        return int(self._rows["uploads"][row].sum()) if row != NO_ROW else 0

    def add_uploads(self, row: int, delta: int) -> None:
        if row != NO_ROW:
            column = self._rows["uploads"][row]
            column[self.slot] = max(0, int(column[self.slot]) + delta)

    # -- tokens -----------------------------------------------------------------------------------

    def held(self, row: int) -> int:
        return int(self._rows["held"][row].sum()) if row != NO_ROW else 0

    def add_held(self, row: int, delta: int) -> None:
        if row != NO_ROW:
            column = self._rows["held"][row]
            column[self.slot] = max(0, int(column[self.slot]) + delta)

    def used(self, row: int, now: float) -> int:
        """Tokens charged in the window ending `now`."""
        if row == NO_ROW:
            return 0
        live = self._rows["at"][row] > now - WINDOW_S
        return int(self._rows["tokens"][row][live].sum())

    def charge(self, row: int, at: float, tokens: int) -> None:
        if row == NO_ROW or tokens <= 0:
            return
        second = math.floor(at)
        place = second % NUM_BUCKETS
        record = self._rows[row]
        if record["second"][place] != second or record["tokens"][place] == 0:
            record["second"][place] = second
            record["at"][place] = at
            record["tokens"][place] = 0
        record["at"][place] = max(float(record["at"][place]), at)
        record["tokens"][place] += tokens

    def seconds_until_freed(self, row: int, excess: int, now: float) -> float | None:
        """Seconds until the oldest charges, leaving the window, free at least `excess` tokens; None when
        even the whole window would not."""
        live = self._rows["at"][row] > now - WINDOW_S
        ats = self._rows["at"][row][live]
        tokens = self._rows["tokens"][row][live]
        freed = 0
        for index in np.argsort(ats, kind="stable"):
            freed += int(tokens[index])
            if freed >= excess:
                return float(ats[index]) + WINDOW_S - now
        return None
