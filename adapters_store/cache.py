"""A bounded local disk cache of fetched adapter folders, in front of a store (LRU by bytes).

Keyed by (tenant, name, version, sha256): versions are never reused and the checksum pins the exact
bytes, so an entry can never serve stale content, and a hit needs no call to the store when the
caller already holds the record. Folders land as `{dir}/{tenant}/{name}/{version}-{sha256}/`, each
downloaded (and checksum-verified) under a temporary name and renamed into place, so a folder with
its final name is always complete; a restart re-indexes them, oldest use first (mtime, touched on
every hit).

Eviction happens when a new entry is inserted, least recently used first, skipping entries pinned
by `checkout()`; while pins hold, the cache may exceed its budget. A lock per key makes concurrent
fetches of one adapter download it once. One process per cache directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from adapters_store.base import AdapterStore
from adapters_store.filenames import ADAPTER_FILES
from adapters_store.metrics import StoreMetrics
from adapters_store.names import is_valid_name
from adapters_store.record import AdapterRecord

log = logging.getLogger(__name__)
CacheKey = tuple[str, str, int, str]  # (tenant, name, version, sha256)
_FOLDER = re.compile(r"(?P<version>[1-9][0-9]*)-(?P<sha256>[0-9a-f]{64})")
_TEMP_PREFIXES = (".tmp-", ".trash-")


@dataclass(frozen=True)
class CachedAdapter:
    record: AdapterRecord
    path: Path  # a folder engine.lora.peft_checkpoint.load_peft_adapter reads
    hit: bool  # served from disk without a download


@dataclass
class _Entry:
    path: Path
    size_bytes: int
    pins: int = 0  # checkouts in progress; a pinned entry is never evicted


class DiskCache:
    """Fetch adapters through a local folder of at most `max_bytes` (beyond what pins hold)."""

    def __init__(
        self,
        store: AdapterStore,
        directory: str | os.PathLike,
        max_bytes: int,
        metrics: StoreMetrics | None = None,
    ):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (got {max_bytes})")
        self.store = store
        self.directory = Path(directory).absolute()
        self.max_bytes = max_bytes
        self.metrics = metrics or store.metrics
        self._lock = threading.Lock()  # guards everything below
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()  # least recently used first
        self._key_locks: dict[CacheKey, threading.Lock] = {}  # one per key ever fetched: tiny, never pruned
        self._total_bytes = 0
        self._load_index()

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, tenant: str, name: str, version: int | None = None) -> CachedAdapter:
        """Resolve with the store (one manifest read), then serve from disk or download."""
        return self.fetch_record(tenant, self.store.get(tenant, name, version))

    def fetch_record(self, tenant: str, record: AdapterRecord) -> CachedAdapter:
        """Unpinned: a later insertion may evict the folder; read it at once, or use checkout()."""
        with self.checkout(tenant, record) as cached:
            return cached

    @contextmanager
    def checkout(self, tenant: str, record: AdapterRecord) -> Iterator[CachedAdapter]:
        """The adapter's folder, guaranteed to stay on disk until the block ends."""
        key = (tenant, record.name, record.version, record.sha256)
        cached = self._acquire(key, tenant, record)
        try:
            yield cached
        finally:
            with self._lock:
                self._entries[key].pins -= 1

    def discard(self, tenant: str, name: str, version: int | None = None) -> int:
        """Drop cached versions of a deleted adapter now instead of waiting for LRU; returns how many."""
        with self._lock:
            keys = [
                key
                for key, entry in self._entries.items()
                if key[:2] == (tenant, name) and (version is None or key[2] == version) and entry.pins == 0
            ]
            victims = [self._pop(key) for key in keys]
        self._delete(victims)
        return len(victims)

    def _acquire(self, key: CacheKey, tenant: str, record: AdapterRecord) -> CachedAdapter:
        if (hit := self._pin_if_cached(key, record)) is not None:
            return hit
        with self._key_lock(key):
            if (hit := self._pin_if_cached(key, record)) is not None:  # another thread just fetched it
                return hit
            self.metrics.cache_miss()
            path = self._download(key, tenant, record)
            size = sum(f.stat().st_size for f in path.iterdir())
            with self._lock:
                self._entries[key] = _Entry(path, size, pins=1)
                self._total_bytes += size
                victims = self._pick_victims()
            self._delete(victims)
            return CachedAdapter(record, path, hit=False)

    def _pin_if_cached(self, key: CacheKey, record: AdapterRecord) -> CachedAdapter | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            entry.pins += 1
        with suppress(OSError):
            os.utime(entry.path)  # recency survives a restart
        self.metrics.cache_hit()
        return CachedAdapter(record, entry.path, hit=True)

    def _key_lock(self, key: CacheKey) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def _download(self, key: CacheKey, tenant: str, record: AdapterRecord) -> Path:
        final = self.directory.joinpath(tenant, record.name, f"{record.version}-{record.sha256}")
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        try:
            self.store.fetch_record(tenant, record, tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():  # an incomplete leftover the index skipped
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _pick_victims(self) -> list[_Entry]:
        """Under the lock: pop unpinned entries, least recently used first, until within budget."""
        victims = []
        for key in list(self._entries):
            if self._total_bytes <= self.max_bytes:
                break
            if self._entries[key].pins == 0:
                victims.append(self._pop(key))
        return victims

    def _pop(self, key: CacheKey) -> _Entry:
        """Under the lock: unindex an entry and move its folder aside, so its name is free at once."""
        entry = self._entries.pop(key)
        self._total_bytes -= entry.size_bytes
        trash = self.directory / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(entry.path, trash)
            entry.path = trash
        except OSError as exc:
            log.warning("could not move evicted %s aside: %s", entry.path, exc)
        return entry

    def _delete(self, victims: list[_Entry]) -> None:
        for entry in victims:
            shutil.rmtree(entry.path, ignore_errors=True)
            self.metrics.cache_eviction(entry.size_bytes)

    def _load_index(self) -> None:
        """Index complete folders left by an earlier run; remove temporary ones."""
        self.directory.mkdir(parents=True, exist_ok=True)
        found = []
        for top in self.directory.iterdir():
            if top.name.startswith(_TEMP_PREFIXES):
                shutil.rmtree(top, ignore_errors=True)
            elif top.is_dir() and is_valid_name(top.name):
                found.extend(_scan_tenant(top))
        for _mtime, key, path, size in sorted(found):
            self._entries[key] = _Entry(path, size)
            self._total_bytes += size
        self._delete(self._pick_victims())


def _scan_tenant(tenant_dir: Path) -> list[tuple[float, CacheKey, Path, int]]:
    found = []
    for name_dir in tenant_dir.iterdir():
        if not (name_dir.is_dir() and is_valid_name(name_dir.name)):
            continue
        for folder in name_dir.iterdir():
            match = _FOLDER.fullmatch(folder.name)
            if match is None or not all((folder / f).is_file() for f in ADAPTER_FILES):
                continue
            key = (tenant_dir.name, name_dir.name, int(match["version"]), match["sha256"])
            size = sum(f.stat().st_size for f in folder.iterdir())
            found.append((folder.stat().st_mtime, key, folder, size))
    return found
