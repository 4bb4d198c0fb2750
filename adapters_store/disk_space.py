"""Local disk space: telling a full disk apart from other write errors, and how much room is left.

A full disk (ENOSPC, or EDQUOT for a quota) is not the store being down and not the caller's mistake: it
becomes DiskFull, which the disk cache answers by evicting and retrying and the API by 507, while other
write errors keep their meaning. `free_bytes` reads the filesystem's free space for callers (statvfs);
tests replace it to play a full disk.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from adapters_store.errors import DiskFull

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


@contextmanager
def disk_full_is_an_error(what: str) -> Iterator[None]:
    """Turn a full disk met inside the block into DiskFull naming `what` (never a path)."""
    try:
        yield
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise DiskFull(
            f"the server's disk is full: {what} could not be written; retry later, or ask the operator to free "
            "space"
        ) from exc


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding `path`."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize
