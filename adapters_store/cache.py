"""A bounded local disk cache of fetched adapter folders, in front of a store (LRU by bytes).

Keyed by (tenant, name, version, sha256): versions are never reused and the checksum pins the exact
bytes, so an entry can never serve stale content, and a hit needs no call to the store when the
caller already holds the record. Folders land as `{dir}/{tenant}/{name}/{version}-{sha256}/`, each
downloaded (and checksum-verified) under a temporary name and renamed into place, so a folder with
its final name is always complete.

Any number of processes may share one directory (the engine's loader processes, the server that
discards deleted versions, replicas on one host): the directory itself is the index, and file locks
(`flock`, which also separates threads, each holding its own descriptor) coordinate them:
- a checkout holds a shared lock on its folder, and eviction takes an entry only if it gets the
  exclusive lock at once, so a folder in use is never removed;
- recency is the folder's mtime, set on every hit, so the LRU order is the same for every process
  and survives a restart;
- inserting, evicting and discarding happen under an exclusive lock on the cache directory, and one
  download per adapter name at a time under a lock on its `{tenant}/{name}` folder, so concurrent
  fetches of one adapter download it once.
Eviction happens when a new entry is inserted (and at start, for a smaller budget), least recently used
first, skipping pinned entries; while pins hold, the cache may exceed its budget.

The disk may fill before the budget does (other files share it, or the budget is larger than the disk).
So before a download the cache also makes room on the disk: if its free space is below the adapter's
size plus `min_free_bytes` (a floor left for everything else on the disk), it evicts unpinned entries,
least recently used first, until it is not; and a download that still meets a full disk (ENOSPC, as
DiskFull) is removed, more entries are evicted, and it is tried again. When nothing is left to evict,
the fetch fails with DiskFull and the cache marks itself out of room for every process (cache_room.py,
which /ready reports) until an insertion succeeds or the space comes back.

Insertion costs no scan of the directory (which is serial across processes and grows with the entry
count): the byte total is kept in a file beside the entries (cache_usage.py: it may err high, never
low), and eviction takes candidates from this process's list of the entries its last scan saw, oldest
first. That list stays a true LRU order across processes: every entry it lacks was inserted or used
after the scan, so is newer than any it holds, and a candidate whose mtime changed since the scan was
used meanwhile and is dropped, not evicted. A pinned candidate stays at the front for the next
eviction. Only when the list runs out does the cache scan again, so a scan serves about as many
evictions as there are entries.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from adapter_format.files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE
from adapters_store import disk_space
from adapters_store.base import AdapterStore
from adapters_store.cache_entries import CacheEntry, file_sizes, scan_cache, scan_name, touch
from adapters_store.cache_room import NoRoomMark
from adapters_store.cache_usage import ByteTotal
from adapters_store.errors import DiskFull
from adapters_store.filenames import MANIFEST_FILE
from adapters_store.metrics import StoreMetrics
from adapters_store.record import AdapterRecord

log = logging.getLogger(__name__)
_TEMP_PREFIXES = (".tmp-", ".trash-")
PINNED = "pinned"  # `_move_aside`'s answer for a folder checked out by someone
# Rounds of evict-and-retry after a download met a full disk; each evicts at least one entry.
MAX_ROOM_ROUNDS = 8


@dataclass(frozen=True)
class CachedAdapter:
    record: AdapterRecord
    path: Path  # a folder adapter_format.checkpoint.load_peft_adapter reads
    hit: bool  # served from disk without a download


class DiskCache:
    """Fetch adapters through a local folder of at most `max_bytes` (beyond what pins hold)."""

    def __init__(
        self,
        store: AdapterStore,
        directory: str | os.PathLike,
        max_bytes: int,
        metrics: StoreMetrics | None = None,
        min_free_bytes: int = 0,
    ):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (got {max_bytes})")
        if min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0 (got {min_free_bytes})")
        self.store = store
        self.directory = Path(directory).absolute()
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.metrics = metrics or store.metrics
        self.directory.mkdir(parents=True, exist_ok=True)
        self._total = ByteTotal(self.directory)
        self._no_room = NoRoomMark(self.directory)
        # Eviction candidates, oldest first: the entries of this process's last scan not yet evicted or
        # dropped. Read and changed only under the directory lock (which separates threads too).
        self._candidates: deque[CacheEntry] = deque()
        with self._locked(self.directory):
            self._remove_leftovers()
            victims, total = self._evict_over_budget(self._rescan(), scanned=True)
            self._total.correct(total)
        self._delete(victims)

    @property
    def total_bytes(self) -> int:
        """The exact bytes on disk (a scan)."""
        return sum(entry.size_bytes for entry in scan_cache(self.directory))

    def __len__(self) -> int:
        return len(scan_cache(self.directory))

    def out_of_room(self) -> bool:
        """True while the last insertion (by any process on this directory) found no room on the disk even
        after evicting every unpinned entry, and the disk has not gained the room it lacked since."""
        mark = self._no_room.read()
        if mark is None:
            return False
        needed, free_then = mark
        try:
            return disk_space.free_bytes(self.directory) < free_then + needed
        except OSError:
            return True

    def cached_versions(self) -> list[tuple[str, str, int]]:
        """(tenant, name, version) of every complete version on disk, for residency metrics."""
        return sorted(
            (entry.path.parent.parent.name, entry.path.parent.name, int(entry.path.name.split("-")[0]))
            for entry in scan_cache(self.directory)
        )

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
        folder = self._folder(tenant, record)
        pin, hit = self._pin(folder), True
        if pin is None:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with self._locked(folder.parent):  # one download of this name at a time, in any process
                pin = self._pin(folder)  # another thread or process may just have fetched it
                if pin is None:
                    pin, hit = self._download(folder, tenant, record), False
        if hit:
            touch(folder)
            self.metrics.cache_hit()
        try:
            yield CachedAdapter(record, folder, hit)
        finally:
            os.close(pin)

    def cached_record(self, tenant: str, name: str, version: int) -> AdapterRecord | None:
        """The record of a version cached here, from the manifest copied along with its files; None if
        it is not cached. Versions are never reused, so a cached one needs no store call to be trusted
        (whether it still exists is resolution's question): a load from disk works while S3 is down."""
        for entry in scan_name(self.directory / tenant / name):
            if not entry.path.name.startswith(f"{version}-"):
                continue
            try:
                record = AdapterRecord.from_json((entry.path / MANIFEST_FILE).read_bytes())
            except (OSError, ValueError):  # moved aside meanwhile, or cached before manifests were copied
                continue
            if (record.name, record.version) == (name, version) and entry.path.name.endswith(record.sha256):
                return record
        return None

    def discard(self, tenant: str, name: str, version: int | None = None) -> int:
        """Drop cached versions of a deleted adapter now instead of waiting for LRU; returns how many."""
        with self._locked(self.directory):
            victims = [
                moved
                for entry in scan_name(self.directory / tenant / name)
                if version is None or entry.path.name.startswith(f"{version}-")
                if isinstance(moved := self._move_aside(entry), CacheEntry)
            ]
            if victims:
                self._total.add(-sum(entry.size_bytes for entry in victims))
        self._delete(victims)
        return len(victims)

    def _pin(self, folder: Path) -> int | None:
        """A descriptor holding a shared lock on the folder, or None if it is not (or no longer) cached."""
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an eviction moves this folder aside
        try:
            current = os.stat(folder)
        except FileNotFoundError:
            current = None
        if current is None or not os.path.samestat(os.fstat(fd), current):  # evicted before the lock
            os.close(fd)
            return None
        if not all((folder / f).is_file() for f in ADAPTER_FILES):  # tampered with: fetched again
            os.close(fd)
            return None
        return fd

    def holds(self, tenant: str, record: AdapterRecord) -> bool:
        """Whether the version is cached now (it may be evicted right after: use checkout() to keep it)."""
        pin = self._pin(self._folder(tenant, record))
        if pin is None:
            return False
        os.close(pin)
        return True

    def insert(self, tenant: str, record: AdapterRecord, config: bytes, weights: bytes | bytearray) -> bool:
        """Cache a version whose files the caller already holds in memory (read with
        `AdapterStore.read_record`, so checked against `record`); False if it was cached already. The
        disk cache filled behind a load that did not wait for it (adapters_store/engine_source.py)."""
        folder = self._folder(tenant, record)
        folder.parent.mkdir(parents=True, exist_ok=True)
        with self._locked(folder.parent):  # as a download: one writer of this name at a time
            pin = self._pin(folder)
            if pin is None:
                files = {CONFIG_FILE: config, WEIGHTS_FILE: weights, MANIFEST_FILE: record.to_json()}
                pin = self._insert(folder, record, lambda tmp: _write_files(tmp, files, record))
                inserted = True
            else:
                inserted = False
        os.close(pin)
        return inserted

    def _folder(self, tenant: str, record: AdapterRecord) -> Path:
        return self.directory.joinpath(tenant, record.name, f"{record.version}-{record.sha256}")

    def _download(self, folder: Path, tenant: str, record: AdapterRecord) -> int:
        """Download into a temporary folder, move it into place, evict for room; returns the new pin."""
        self.metrics.cache_miss()
        return self._insert(folder, record, lambda tmp: self.store.fetch_record(tenant, record, tmp))

    def _insert(self, folder: Path, record: AdapterRecord, fill) -> int:
        """`fill(tmp)` writes `record`'s files into a temporary folder (DiskFull on a full disk), which then
        moves into place; evicts for room; returns the new pin."""
        tmp = self.directory / f".tmp-{uuid.uuid4().hex}"
        with disk_space.disk_full_is_an_error(f"a local copy of adapter {record.ref}"):
            tmp.mkdir()
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # tells other processes' start-up clean-up that it is in use
        try:
            self._fill_with_room(record, tmp, fill)
            size = sum(file_sizes(tmp).values())
            with self._locked(self.directory):
                if folder.exists():  # incomplete (a complete one would have been pinned): replaced
                    shutil.rmtree(folder)
                total = self._total.add(size)  # before the rename: a crash in between errs high
                os.rename(tmp, folder)
                touch(folder)
                # Now a pin; under the directory lock: no eviction sees it free.
                fcntl.flock(fd, fcntl.LOCK_SH)
                victims, left = self._evict_over_budget(total)
                if left != total:
                    self._total.write(left)
        except BaseException:
            os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._delete(victims)
        self._no_room.clear()
        return fd

    def _fill_with_room(self, record: AdapterRecord, tmp: Path, fill) -> None:
        """`fill(tmp)`, making room on the disk first and again each time the disk turns out full."""
        need = record.size_bytes  # the weights; the config and the manifest are a few KiB
        self._make_room(need, after_failure=False)
        for _ in range(MAX_ROOM_ROUNDS):
            try:
                fill(tmp)
                return
            except DiskFull:
                for leftover in tmp.iterdir():  # what the failed attempt wrote
                    leftover.unlink(missing_ok=True)
                self._make_room(need, after_failure=True)
        self._out_of_room(need, record)

    def _make_room(self, need: int, after_failure: bool) -> None:
        """Evict unpinned entries until the disk has `need` bytes free beyond `min_free_bytes`; after a
        download met a full disk, at least one (the free space a filesystem reports may not all be usable)
        or DiskFull when there is none left to evict."""
        try:
            short = need + self.min_free_bytes - disk_space.free_bytes(self.directory)
        except OSError:
            short = need
        if short <= 0 and not after_failure:
            return
        with self._locked(self.directory):
            victims, freed = self._evict_for_room(max(short, 1))
        self._delete(victims)
        if victims:
            log.warning(
                "adapter cache disk short of room: evicted %d entries (%d bytes) for an adapter of %d bytes",
                len(victims),
                freed,
                need,
            )
        elif after_failure:
            self._out_of_room(need, None)

    def _out_of_room(self, need: int, record: AdapterRecord | None) -> None:
        try:
            free = disk_space.free_bytes(self.directory)
        except OSError:
            free = 0
        self._no_room.set(need, free)
        what = f"adapter {record.ref}" if record is not None else "an adapter"
        log.error(
            "adapter cache at %s is out of disk room: %s needs %d bytes and every cached entry left is in use",
            self.directory,
            what,
            need,
        )
        raise DiskFull(
            "this server's adapter cache disk is full and everything on it is in use; retry later, or ask the "
            "operator to free space or raise the disk's size"
        )

    def _evict_for_room(self, amount: int) -> tuple[list[CacheEntry], int]:
        """Under the directory lock: move unpinned entries aside, least recently used first, until they
        hold `amount` bytes (or none is left); returns them for `_delete`, and their bytes (also taken off
        the stored total)."""
        victims, pinned, freed, scanned = [], [], 0, False
        while freed < amount:
            if not self._candidates:
                if scanned:
                    break
                pinned.clear()
                total, scanned = self._rescan(), True
                self._total.correct(total)
                continue
            entry = self._candidates.popleft()
            moved = self._move_aside(entry, unused_since_scan=True)
            if moved is PINNED:
                pinned.append(entry)
            elif moved is not None:
                victims.append(moved)
                freed += entry.size_bytes
        self._candidates.extendleft(reversed(pinned))
        if freed:
            self._total.add(-freed)
        return victims, freed

    def _evict_over_budget(self, total: int | None, scanned: bool = False) -> tuple[list[CacheEntry], int]:
        """Under the directory lock: move unpinned entries aside, least recently used first, until the
        total (None: unknown, so scan) is within budget; returns them for `_delete`, and the new total
        (exact if it scanned) for the caller to store."""
        if total is None:
            total, scanned = self._rescan(), True
        victims, pinned = [], []
        while total > self.max_bytes:
            if not self._candidates:
                if scanned:
                    break  # the rest is checked out: over budget until those pins go
                pinned.clear()  # the scan lists them again, in their order
                total, scanned = self._rescan(), True
                continue
            entry = self._candidates.popleft()
            moved = self._move_aside(entry, unused_since_scan=True)
            if moved is PINNED:
                pinned.append(entry)
            elif moved is not None:
                victims.append(moved)
                total -= entry.size_bytes
        self._candidates.extendleft(reversed(pinned))  # still the oldest: tried first next time
        return victims, total

    def _rescan(self) -> int:
        """Under the directory lock: list every entry as the eviction candidates; returns the exact total."""
        entries = sorted(scan_cache(self.directory), key=lambda entry: (entry.used_at, str(entry.path)))
        self._candidates = deque(entries)
        return sum(entry.size_bytes for entry in entries)

    def _move_aside(self, entry: CacheEntry, unused_since_scan: bool = False) -> CacheEntry | str | None:
        """Under the directory lock: rename an unpinned entry to a trash name (its name is free at once).
        PINNED if it is checked out; None if it is gone or, with `unused_since_scan`, was used since
        `entry` was scanned (so it is no longer among the oldest)."""
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # checked out
                return PINNED
            if unused_since_scan and os.fstat(fd).st_mtime_ns != entry.used_at:
                return None
            trash = self.directory / f".trash-{uuid.uuid4().hex}"
            try:
                os.rename(entry.path, trash)
            except OSError as exc:
                log.warning("could not move evicted %s aside: %s", entry.path, exc)
                return None
        finally:
            os.close(fd)
        return CacheEntry(trash, entry.size_bytes, entry.used_at)

    def _delete(self, victims: list[CacheEntry]) -> None:
        for entry in victims:
            shutil.rmtree(entry.path, ignore_errors=True)
            self.metrics.cache_eviction(entry.size_bytes)

    def _remove_leftovers(self) -> None:
        """Under the directory lock: remove temporary folders no process is using (a crash's leftovers)."""
        for path in self.directory.iterdir():
            if not path.name.startswith(_TEMP_PREFIXES):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a download in progress in another process
                continue
            else:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)

    @contextmanager
    def _locked(self, directory: Path) -> Iterator[None]:
        """An exclusive lock on a folder, against other threads and processes alike."""
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _write_files(folder: Path, files: dict[str, bytes | bytearray], record: AdapterRecord) -> None:
    with disk_space.disk_full_is_an_error(f"a local copy of adapter {record.ref}"):  # DiskFull: evicts
        for name, data in files.items():
            with open(folder / name, "wb") as f:
                f.write(data)
