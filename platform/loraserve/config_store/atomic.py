"""Crash-safe file replacement: readers see the old bytes or the new ones, never a mix.

The new content goes to a hidden temp file in the same directory (same filesystem, so the rename is
atomic), is flushed and fsynced, then `os.replace`d over the target; the directory is fsynced so the
rename itself survives a power cut. A process killed mid-write leaves at most a `.NAME.*.tmp` file,
which readers ignore (names starting with '.' are never records).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_dir(path.parent)


def atomic_delete(path: Path) -> bool:
    """Unlink is atomic already; fsync the directory so the deletion is durable too."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def fsync_dir(directory: Path) -> None:
    # Directories cannot be opened for fsync on every OS (Windows); durability is best effort there.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
