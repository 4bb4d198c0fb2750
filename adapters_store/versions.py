"""The state of each version folder of one adapter, read from its keys alone (pure; table-tested).

    committed: manifest.json and no deleted.json   <- the only versions readers see
    deleted:   deleted.json (its number is never handed out again; leftover files may be swept)
    partial:   neither, e.g. an upload still running or one that died before its manifest

A partial version is swept once its newest key is older than the store's `stale_upload_s` (an upload
still running on another replica is younger than that), so the store ends up holding only committed
and deleted versions, and the number a dead upload took is free again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from adapter_format.files import CONFIG_FILE
from adapter_format.names import parse_version
from adapters_store.filenames import MANIFEST_FILE

TOMBSTONE_FILE = "deleted.json"


@dataclass
class VersionKeys:
    files: dict[str, float] = field(default_factory=dict)  # file name -> last modified (unix seconds)

    @property
    def committed(self) -> bool:
        return MANIFEST_FILE in self.files and TOMBSTONE_FILE not in self.files

    @property
    def deleted(self) -> bool:
        return TOMBSTONE_FILE in self.files

    @property
    def newest(self) -> float:
        return max(self.files.values(), default=0.0)


def scan_versions(keys: Mapping[str, float]) -> dict[int, VersionKeys]:
    """`{"3/manifest.json": mtime, ...}` (keys under one adapter's folder) -> version -> VersionKeys.

    Keys outside numbered folders (temporary folders, stray objects) are ignored.
    """
    versions: dict[int, VersionKeys] = {}
    for key, modified in keys.items():
        segment, _, filename = key.partition("/")
        version = parse_version(segment)
        if version is not None and filename and "/" not in filename:
            versions.setdefault(version, VersionKeys()).files[filename] = modified
    return versions


def sweepable(versions: Mapping[int, VersionKeys], now: float, stale_s: float) -> list[tuple[int, list[str]]]:
    """(version, files to remove in order): stale partial versions whole, and what deleted versions left.

    The order is the manifest first (the version disappears), adapter_config.json last (on S3 it is the
    claim on the number, held until the rest is gone).
    """
    out = []
    for version, state in sorted(versions.items()):
        if state.deleted:
            leftovers = [f for f in state.files if f != TOMBSTONE_FILE]
        elif not state.committed and now - state.newest > stale_s:
            leftovers = list(state.files)
        else:
            continue
        if leftovers:
            out.append((version, sorted(leftovers, key=lambda f: (f == CONFIG_FILE, f != MANIFEST_FILE, f))))
    return out
