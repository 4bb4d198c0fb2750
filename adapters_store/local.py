"""The local-directory backend: the embedded default (`file://./.loraserve/adapters`).

A version is published by one `os.rename` of a fully written folder (files and manifest inside),
so readers see all of it or nothing, and a crash leaves only a hidden `.incoming-*` folder, which
holds no version number and is swept later. The rename also claims the number: it fails when the
target exists, and the loser of two concurrent uploads simply tries the next number. POSIX only.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO, TypeVar

from adapter_format.files import ADAPTER_FILES
from adapter_format.model_shape import ModelShape
from adapters_store.base import AdapterStore, MissingKey
from adapters_store.config import StoreConfig
from adapters_store.disk_space import is_disk_full
from adapters_store.errors import DiskFull, StoreUnavailable
from adapters_store.filenames import MANIFEST_FILE
from adapters_store.metrics import StoreMetrics
from adapters_store.record import AdapterRecord
from adapters_store.streams import fsync_path

T = TypeVar("T")
INCOMING_PREFIX = ".incoming-"
MAX_CLAIM_ATTEMPTS = 100


class LocalStore(AdapterStore):
    """Adapters under one directory on this machine."""

    def __init__(
        self,
        root: str | os.PathLike,
        config: StoreConfig,
        shape: ModelShape | None = None,
        metrics: StoreMetrics | None = None,
    ):
        super().__init__(config, shape, metrics)
        self.root = Path(root).absolute()  # immune to later chdir

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def __reduce__(self):
        """The same store in another process (an engine loader process); metrics stay behind."""
        return LocalStore, (self.root, self.config, self.shape)

    def check(self) -> None:
        probe = self.root / f".probe-{uuid.uuid4().hex}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StoreUnavailable(
                f"adapter store directory {self.root} is not writable ({exc}); fix its permissions or pick "
                "another --adapter-store",
                str(exc),
            ) from None

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except FileNotFoundError as exc:
            raise MissingKey(exc.filename) from None
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFull(
                    f"the adapter store's disk is full: {operation} failed; free space there"
                ) from exc
            raise StoreUnavailable(
                f"{operation} failed: {exc}; check the permissions and free space of {self.root}", str(exc)
            ) from exc

    def _list_times(self, prefix: str) -> dict[str, float]:
        base = self.root / prefix
        times = {}
        for dirpath, _, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(base).as_posix()
            for name in filenames:
                with suppress(FileNotFoundError):  # removed since the walk listed it
                    times[name if rel == "." else f"{rel}/{name}"] = (Path(dirpath) / name).stat().st_mtime
        return times

    def _read(self, key: str) -> bytes:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            raise MissingKey(key) from None

    def _open(self, key: str) -> BinaryIO:
        try:
            return open(self.root / key, "rb")
        except FileNotFoundError:
            raise MissingKey(key) from None

    def _link(self, key: str, dest: Path) -> bool:
        """A hard link where the disk cache shares this filesystem: a fetch then writes nothing, and the
        page cache holds one copy. Safe because a stored file is never changed in place (versions are
        never reused; `_write` replaces files by rename)."""
        try:
            os.link(self.root / key, dest)
        except FileNotFoundError:
            if (self.root / key).exists():  # `dest`'s folder is missing: not the store's problem
                raise
            raise MissingKey(key) from None
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
                return False  # another filesystem, or links not allowed: `_download` copies instead
            raise
        return True

    def _write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_durably(path, data)

    def _remove(self, key: str) -> None:
        path = self.root / key
        path.unlink(missing_ok=True)
        if path.parent != self.root:
            with suppress(OSError):  # a version folder emptied by a sweep goes too; any other stays
                path.parent.rmdir()

    def _commit(
        self, tenant: str, name: str, folder: Path, record_for: Callable[[int], AdapterRecord]
    ) -> AdapterRecord:
        name_dir = self.root / tenant / name
        incoming = name_dir / f"{INCOMING_PREFIX}{uuid.uuid4().hex}"
        try:
            name_dir.mkdir(parents=True, exist_ok=True)
            _sweep_stale(name_dir, self.config.stale_upload_s)
            incoming.mkdir()
            for filename in ADAPTER_FILES:
                shutil.move(folder / filename, incoming / filename)  # a rename when staging shares the disk
                fsync_path(incoming / filename)
            for _ in range(MAX_CLAIM_ATTEMPTS):
                record = record_for(self._next_version(tenant, name))
                _write_durably(incoming / MANIFEST_FILE, record.to_json())
                fsync_path(incoming)
                try:
                    os.rename(incoming, name_dir / str(record.version))  # publish: all or nothing
                except OSError as exc:
                    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        continue  # a concurrent upload took this number first
                    raise
                fsync_path(name_dir)
                return record
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFull(
                    f"the adapter store's disk is full: {tenant}/{name} could not be stored; retry later, or "
                    "ask the operator to free space"
                ) from exc
            raise StoreUnavailable(
                f"storing {tenant}/{name} failed: {exc}; check the permissions and free space of {self.root}",
                str(exc),
            ) from exc
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
        raise StoreUnavailable(f"could not claim a version of {tenant}/{name} in {MAX_CLAIM_ATTEMPTS} tries")


def _write_durably(path: Path, data: bytes) -> None:
    """Write to a hidden temporary name, flush, then rename: never a torn manifest."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sweep_stale(name_dir: Path, stale_s: float) -> None:
    """Remove `.incoming-*` folders left by uploads that died long ago (they are invisible anyway)."""
    cutoff = time.time() - stale_s
    for entry in name_dir.iterdir():
        try:
            if entry.name.startswith(INCOMING_PREFIX) and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:  # another upload swept it first
            pass
