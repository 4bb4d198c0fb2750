"""Whether the disk cache could not make room on its disk, shared by every process that uses one cache
directory (the engine's loader processes fetch; the server's /ready reports).

One small file in the cache directory holds, after an insertion found no room even with every unpinned
entry evicted, the bytes it needed and the free space the filesystem reported then; an insertion that
succeeds clears it. It is created while there is room and then rewritten in place at a fixed width, so
marking a full disk needs no new block on it; every write is best effort (the next insertion tries
again). The state lasts until the disk has gained the room that was lacking: reported free space alone
cannot say, since a filesystem may report room it will not give (reserved blocks, quotas).
"""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path

ROOM_FILE = ".no-room"  # hidden: never a tenant's folder
_WIDTH = 20
_NONE = b"0" * (2 * _WIDTH + 1) + b"\n"


class NoRoomMark:
    def __init__(self, directory: Path):
        self.path = directory / ROOM_FILE
        if not self.path.exists():
            self._write(_NONE)

    def set(self, needed_bytes: int, free_bytes: int) -> None:
        self._write(f"{max(needed_bytes, 1):0{_WIDTH}d} {max(free_bytes, 0):0{_WIDTH}d}\n".encode())

    def clear(self) -> None:
        if self.read() is not None:
            self._write(_NONE)

    def read(self) -> tuple[int, int] | None:
        """(bytes needed, free bytes reported then) of the last insertion that found no room; None if the
        last one had room (or nothing is known)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(len(_NONE) + 1)
        except OSError:
            return None
        fields = data.split()
        if len(data) != len(_NONE) or len(fields) != 2 or not all(f.isdigit() for f in fields):
            return None
        needed, free = int(fields[0]), int(fields[1])
        return (needed, free) if needed else None

    def _write(self, data: bytes) -> None:
        with suppress(OSError):
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)
