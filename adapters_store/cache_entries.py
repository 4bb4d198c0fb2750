"""The disk cache's entries as the directory shows them: complete version folders, their bytes and recency.

An entry is `{dir}/{tenant}/{name}/{version}-{sha256}/` holding every adapter file; its recency is the
folder's mtime, which the cache sets on every download and hit, so every process sees one LRU order
and it survives a restart.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from adapter_format.files import ADAPTER_FILES
from adapter_format.names import VERSION_PATTERN, is_valid_name

_FOLDER = re.compile(rf"(?P<version>{VERSION_PATTERN})-(?P<sha256>[0-9a-f]{{64}})")


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size_bytes: int
    used_at: int  # the folder's mtime in ns: its last download or hit


def scan_cache(directory: Path) -> list[CacheEntry]:
    """Every complete entry on disk. About 30 ms at 450 entries: the cache runs it only at start and when
    an eviction has no candidates left, never on every insertion."""
    entries = []
    with os.scandir(directory) as tenants:
        for tenant_dir in tenants:
            if tenant_dir.is_dir() and is_valid_name(tenant_dir.name):
                with suppress(FileNotFoundError, NotADirectoryError), os.scandir(tenant_dir.path) as names:
                    for name_dir in names:
                        if is_valid_name(name_dir.name):
                            entries.extend(scan_name(Path(name_dir.path)))
    return entries


def scan_name(name_dir: Path) -> list[CacheEntry]:
    """The complete entries of one adapter name. With `os.scandir`, file types come with the listing (one
    stat per file)."""
    entries = []
    with suppress(FileNotFoundError, NotADirectoryError), os.scandir(name_dir) as listing:
        for folder in listing:
            if _FOLDER.fullmatch(folder.name) is None:
                continue
            with suppress(FileNotFoundError, NotADirectoryError):  # moved aside by another process meanwhile
                sizes = file_sizes(Path(folder.path))
                if all(name in sizes for name in ADAPTER_FILES):
                    used_at = folder.stat().st_mtime_ns
                    entries.append(CacheEntry(Path(folder.path), sum(sizes.values()), used_at))
    return entries


def file_sizes(folder: Path) -> dict[str, int]:
    """Bytes of each plain file directly in `folder`."""
    with os.scandir(folder) as files:
        return {f.name: f.stat().st_size for f in files if f.is_file()}


def touch(folder: Path) -> None:
    """Mark a folder used now. An explicit time keeps full precision (the kernel's own stamps are as
    coarse as a clock tick, which would tie entries used within a few milliseconds)."""
    now = time.time_ns()
    with suppress(OSError):
        os.utime(folder, ns=(now, now))
