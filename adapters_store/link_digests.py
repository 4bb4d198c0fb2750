"""The sha256 of hard-linked store files, remembered by file identity: one hash per file and process.

A local store's file reaches the disk cache as a hard link (LocalStore._link), so the cache entry is the
stored file itself, and a cache hit on it trusts it with no hash at all. Hashing it again at every fetch
(about 24 ms for 22.5 MB, most of a fetch) proves nothing new while the file is unchanged; so once a
linked file is hashed, its identity (device, inode, size, mtime in ns) is remembered with its digest,
and a later link to a file of the same identity takes that digest.

Why this is safe: a file with the same device and inode is the same file; any write to it (in place, or
a truncation) sets its mtime, and a file replaced by a rename is another inode. What mtime cannot show
is a write within the same clock tick as the remembered mtime (file timestamps are as coarse as a
tick), so, as git does for its index, only a file whose mtime is over `SETTLED_NS` older than the start
of its hash, and whose identity did not change while it was hashed, is remembered. That rule also rules
out a deleted file's inode number coming back with the same size and mtime. Someone who rewrites a
stored file and then sets its mtime back on purpose can as well rewrite its manifest: the checksum
guards against corruption and mistakes, not against whoever controls the store.

Copies (another filesystem) and S3 downloads are fresh bytes, always hashed as they arrive.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

SETTLED_NS = 1_000_000_000  # far beyond any filesystem's timestamp granularity
MAX_REMEMBERED = 16384  # files; about 200 bytes each


class LinkDigests:
    """Per process: the store object keeps one (a loader process builds its own store, so its own)."""

    def __init__(self) -> None:
        # (device, inode) -> (size, mtime_ns, digest), least recently used first
        self._known: OrderedDict[tuple[int, int], tuple[int, int, str]] = OrderedDict()
        self._lock = threading.Lock()  # loader threads share one store

    def sha256(self, path: Path) -> tuple[int, str]:
        """(size, sha256 hex digest) of the file at `path`, hashed unless its identity is remembered."""
        seen = os.stat(path)
        key = (seen.st_dev, seen.st_ino)
        with self._lock:
            known = self._known.get(key)
            if known is not None and known[:2] == (seen.st_size, seen.st_mtime_ns):
                self._known.move_to_end(key)
                return known[0], known[2]
        started = time.time_ns()
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            after = os.fstat(f.fileno())
        unchanged = (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns)
        if unchanged and before.st_mtime_ns < started - SETTLED_NS:
            with self._lock:
                self._known[(before.st_dev, before.st_ino)] = (before.st_size, before.st_mtime_ns, digest)
                if len(self._known) > MAX_REMEMBERED:
                    self._known.popitem(last=False)
        return before.st_size, digest
