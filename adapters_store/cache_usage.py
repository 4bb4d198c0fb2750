"""The disk cache's byte total, shared by every process that uses one cache directory.

One small file in the cache directory holds the bytes of all complete entries, kept up to date by each
insertion, eviction and discard under the directory's exclusive lock, so an insertion learns whether
the cache is over budget with one read instead of a scan of every entry (which took about 30 ms at 450
entries and, being serial across the loader processes, capped W2 at about 33 insertions a second).

The total may only err high, never low: an insertion adds its bytes before renaming its folder into
place, so a crash in between counts a folder that is not there (costing an early eviction, never a
budget overrun), and anything removed behind the cache's back (by hand, or a tampered folder) stays
counted. Every scan (at start, and whenever an eviction runs out of candidates) writes the exact total.
Absent (no insertion yet), unreadable or torn means unknown: the next insertion scans.
"""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path

USAGE_FILE = ".usage"  # hidden: never a tenant's folder (names start with a letter or digit)
_WIDTH = 20  # digits: every write has the same length, so an overwrite in place leaves no stale tail


class ByteTotal:
    """Read and write the total; every call must hold the cache directory's exclusive lock."""

    def __init__(self, directory: Path):
        self.path = directory / USAGE_FILE

    def read(self) -> int | None:
        """The total, or None when unknown."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(_WIDTH + 2)
        except FileNotFoundError:
            return None
        if len(data) != _WIDTH + 1 or not data[:_WIDTH].isdigit() or data[_WIDTH:] != b"\n":
            return None
        return int(data[:_WIDTH])

    def write(self, total: int) -> None:
        if total < 0:  # it never errs low, so this means someone meddled: count again at the next insertion
            self.forget()
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, f"{total:0{_WIDTH}d}\n".encode(), 0)
        finally:
            os.close(fd)

    def add(self, delta: int) -> int | None:
        """Add `delta` bytes; returns the new total, or None (and writes nothing) when it is unknown."""
        total = self.read()
        if total is not None:
            total += delta
            self.write(total)
        return total

    def correct(self, total: int) -> None:
        """After a scan: store the exact total, where a total is kept at all (created by insertions only)."""
        if self.path.exists():
            self.write(total)

    def forget(self) -> None:
        with suppress(FileNotFoundError):
            self.path.unlink()
