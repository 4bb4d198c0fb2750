"""The adapter store interface, with everything the backends share.

Layout, keys relative to the store root (a directory, or an S3 bucket prefix):

    {tenant}/{name}/{version}/adapter_config.json
    {tenant}/{name}/{version}/adapter_model.safetensors
    {tenant}/{name}/{version}/manifest.json      <- written last: the commit mark
    {tenant}/{name}/{version}/deleted.json       <- written first by delete, so the number is never reused

A version is visible only while it has a manifest and no tombstone (versions.py), so an upload killed
midway is invisible and deletion hides a version at once, before its files go. Version numbers count
up per (tenant, name) from 1: the next one is 1 + the highest number with any key at all (committed,
deleted, or an upload in progress), so `name@3` means the same bytes forever, or nothing. A failed
upload removes what it wrote, and half-written versions older than `stale_upload_s` (uploads that
died) are swept before each upload of that name and by `sweep()`: the store holds only committed and
deleted versions, and a dead upload's number is taken by the next one. Backends implement five
primitives on keys and `_commit`, which claims a number and publishes the files.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

from adapter_format.files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapter_format.names import check_adapter_name, check_tenant, check_version, is_valid_name, parse_ref
from adapter_format.peft_config import MAX_CONFIG_BYTES
from adapters_store.config import StoreConfig
from adapters_store.disk_space import disk_full_is_an_error
from adapters_store.errors import AdapterNotFound, ChecksumError, InvalidAdapter, StoreError
from adapters_store.filenames import MANIFEST_FILE
from adapters_store.intake import UploadSource, stage_upload
from adapters_store.link_digests import LinkDigests
from adapters_store.metrics import StoreMetrics
from adapters_store.record import AdapterRecord, check_parser_name, recorded_base_model, utc_now_iso
from adapters_store.streams import CHUNK_BYTES
from adapters_store.validate import CheckedAdapter, check_folder
from adapters_store.versions import TOMBSTONE_FILE, scan_versions, sweepable

log = logging.getLogger(__name__)
T = TypeVar("T")


class MissingKey(KeyError):
    """A backend primitive found no object at that key (translated by the store, never raised to users)."""


class AdapterStore(ABC):
    """Upload, list, resolve, download and delete adapters of many tenants."""

    def __init__(
        self, config: StoreConfig, shape: ModelShape | None = None, metrics: StoreMetrics | None = None
    ):
        self.config = config
        self.shape = shape  # the base model's; needed only to validate uploads
        self.metrics = metrics or StoreMetrics()
        self.clock = time.time  # compared with the backend's last-modified times when sweeping
        self._link_digests = LinkDigests()  # where `_link` works

    # ---- public API -------------------------------------------------------------------------------

    def put(
        self, tenant: str, name: str, source: UploadSource, *, tool_call_parser: str | None = None
    ) -> AdapterRecord:
        """Validate `source` completely, then store it as the next version of `name` (with the tool-call
        parser its record names, if any)."""
        check_tenant(tenant)
        check_adapter_name(name)
        if tool_call_parser is not None:
            try:
                check_parser_name(tool_call_parser)
            except ValueError as exc:
                raise InvalidAdapter(str(exc), "bad_upload") from None
        if self.shape is None:
            raise RuntimeError("this store was opened without the base model's ModelShape; uploads need it")
        with self.staging() as staging, disk_full_is_an_error("the upload"):
            folder = stage_upload(source, staging, self.config, self.shape)
            checked = check_folder(
                folder, self.shape, self.config.max_lora_rank, self.config.vocab_modules_served
            )
            created_at = utc_now_iso()
            self._sweep_name(tenant, name)
            record = self._commit(
                tenant,
                name,
                folder,
                lambda version: _record(
                    name, version, checked, created_at, self.config.served_model, tool_call_parser
                ),
            )
        log.info(
            "stored adapter %s/%s (rank %d, %d bytes)", tenant, record.ref, record.rank, record.size_bytes
        )
        return record

    @contextmanager
    def staging(self) -> Iterator[Path]:
        """A new empty private folder under `staging_dir` (the system temp dir by default), removed with
        everything in it when the block ends: where an upload is written before it is checked and stored.
        An upload written here as it arrives is then stored with `put(tenant, name, Staged(...))`."""
        root = self.config.staging_dir
        with disk_full_is_an_error("the upload"):
            if root is not None:
                Path(root).mkdir(parents=True, exist_ok=True)
            staging = tempfile.mkdtemp(prefix="loraserve-upload-", dir=root)
        try:
            yield Path(staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def list(self, tenant: str, *, all_versions: bool = False) -> builtins.list[AdapterRecord]:
        """The tenant's adapters sorted by name: the latest version of each, or every version."""
        check_tenant(tenant)
        times = self._call(f"list adapters of {tenant}", lambda: self._list_times(f"{tenant}/"))
        by_name: dict[str, dict[str, float]] = {}
        for key, modified in times.items():
            name, _, rest = key.partition("/")
            if is_valid_name(name):
                by_name.setdefault(name, {})[rest] = modified
        committed = {
            name: [v for v, state in scan_versions(keys).items() if state.committed]
            for name, keys in by_name.items()
        }
        records = []
        for name, versions in sorted(committed.items()):
            for version in sorted(versions, reverse=True):
                record = self._read_manifest(tenant, name, version)
                if record is not None:
                    records.append(record)
                    if not all_versions:
                        break
        return sorted(records, key=lambda r: (r.name, r.version))

    def versions(self, tenant: str, name: str) -> builtins.list[AdapterRecord]:
        """Every committed version of one adapter, oldest first; AdapterNotFound if there is none."""
        check_tenant(tenant)
        check_adapter_name(name)
        records = [
            r for v in self._committed_versions(tenant, name) if (r := self._read_manifest(tenant, name, v))
        ]
        if not records:
            raise AdapterNotFound(f"no adapter named {name!r}; upload it first (POST /v1/adapters)")
        return records

    def get(self, tenant: str, name: str, version: int | None = None) -> AdapterRecord:
        """One version's record; version None means the latest committed one."""
        check_tenant(tenant)
        check_adapter_name(name)
        if version is None:
            for latest in reversed(self._committed_versions(tenant, name)):
                if record := self._read_manifest(tenant, name, latest):
                    return record
            raise AdapterNotFound(f"no adapter named {name!r}; upload it first (POST /v1/adapters)")
        check_version(version)
        if record := self._read_manifest(tenant, name, version):
            return record
        known = self._committed_versions(tenant, name)
        hint = f"its versions are {', '.join(map(str, known))}" if known else "no version of it exists"
        raise AdapterNotFound(f"adapter {name!r} has no version {version}; {hint}")

    def resolve(self, tenant: str, ref: str) -> AdapterRecord:
        """`name` (the latest) or `name@version`, as requests and routes spell adapters."""
        name, version = parse_ref(ref)
        return self.get(tenant, name, version)

    def fetch(self, tenant: str, name: str, version: int | None, dest_dir: str | os.PathLike) -> Path:
        """Download one version into `dest_dir`, ready for adapter_format.checkpoint.load_peft_adapter."""
        return self.fetch_record(tenant, self.get(tenant, name, version), dest_dir)

    def fetch_record(self, tenant: str, record: AdapterRecord, dest_dir: str | os.PathLike) -> Path:
        """Download the version `record` describes; ChecksumError if the weights differ from its manifest.

        Each file lands under a temporary name and is renamed into place once complete and checked,
        so `dest_dir` never holds a partial file under its real name. The manifest is copied along.
        """
        check_tenant(tenant)
        dest = Path(dest_dir)
        start = time.monotonic()
        with disk_full_is_an_error(f"a local copy of adapter {record.ref}"):  # DiskFull: the cache evicts
            dest.mkdir(parents=True, exist_ok=True)
            self._download(tenant, record, CONFIG_FILE, dest, MAX_CONFIG_BYTES)
            self._download(tenant, record, WEIGHTS_FILE, dest, record.size_bytes)
            (dest / MANIFEST_FILE).write_bytes(record.to_json())
        self.metrics.fetch_seconds(time.monotonic() - start)
        return dest

    def delete(self, tenant: str, name: str, version: int | None = None) -> builtins.list[AdapterRecord]:
        """Delete one version, or every committed version when version is None; returns what was deleted.

        Per version: a tombstone first (readers stop seeing the version at once, and its number stays
        taken even if the rest fails), then the manifest and the files; `sweep` removes what a failed
        delete left. Half-written versions of an upload still running are left alone.
        """
        records = [self.get(tenant, name, version)] if version is not None else self.versions(tenant, name)
        tombstone = json.dumps({"deleted_at": utc_now_iso()}).encode()
        for record in records:
            prefix = _version_prefix(tenant, name, record.version)
            op = f"delete {tenant}/{record.ref}"
            self._call(op, lambda p=prefix: self._write(p + TOMBSTONE_FILE, tombstone))
            for filename in (MANIFEST_FILE, *ADAPTER_FILES):
                self._call(op, lambda p=prefix, f=filename: self._remove(p + f))
            log.info("deleted adapter %s/%s", tenant, record.ref)
        return records

    def sweep(self) -> int:
        """Remove half-written versions older than `stale_upload_s` and the leftovers of failed deletes,
        in the whole store (e.g. at start); returns how many versions were cleaned."""
        times = self._call("list the adapter store", lambda: self._list_times(""))
        by_adapter: dict[str, dict[str, float]] = {}
        for key, modified in times.items():
            tenant, _, rest = key.partition("/")
            name, _, rest = rest.partition("/")
            if is_valid_name(tenant) and is_valid_name(name):
                by_adapter.setdefault(f"{tenant}/{name}/", {})[rest] = modified
        return sum(self._sweep_keys(prefix, keys) for prefix, keys in by_adapter.items())

    @abstractmethod
    def check(self) -> None:
        """Raise StoreUnavailable unless the store can be read and written (for startup and /ready)."""

    # ---- backend primitives (keys are relative to the store root; no retries or translation) ------

    def _list_keys(self, prefix: str) -> builtins.list[str]:
        """Every key under `prefix` (which ends with '/' or is empty), relative to it."""
        return sorted(self._list_times(prefix))

    @abstractmethod
    def _list_times(self, prefix: str) -> dict[str, float]:
        """Every key under `prefix`, relative to it, with its last-modified time (unix seconds)."""

    @abstractmethod
    def _read(self, key: str) -> bytes:
        """A small object's bytes; MissingKey if absent."""

    @abstractmethod
    def _open(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A readable stream of an object; MissingKey if absent."""

    def _link(self, key: str, dest: Path) -> bool:
        """Make `dest` a hard link to the object, where the backend keeps it as a file on this filesystem;
        False where it cannot (then `_download` copies it). MissingKey if absent."""
        return False

    @abstractmethod
    def _write(self, key: str, data: bytes) -> None:
        """Create or replace a small object atomically."""

    @abstractmethod
    def _remove(self, key: str) -> None:
        """Remove an object; absent is fine."""

    @abstractmethod
    def _commit(
        self, tenant: str, name: str, folder: Path, record_for: Callable[[int], AdapterRecord]
    ) -> AdapterRecord:
        """Claim the next free version, store the folder's two files and, last, the manifest."""

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        """Run one primitive: backends add retries and turn their errors into MissingKey/StoreUnavailable."""
        return fn()

    # ---- shared helpers ---------------------------------------------------------------------------

    def _adapter_times(self, tenant: str, name: str) -> dict[str, float]:
        prefix = f"{tenant}/{name}/"
        return self._call(f"list versions of {tenant}/{name}", lambda: self._list_times(prefix))

    def _next_version(self, tenant: str, name: str) -> int:
        return max(scan_versions(self._adapter_times(tenant, name)), default=0) + 1

    def _committed_versions(self, tenant: str, name: str) -> builtins.list[int]:
        versions = scan_versions(self._adapter_times(tenant, name))
        return sorted(v for v, state in versions.items() if state.committed)

    def _sweep_name(self, tenant: str, name: str) -> None:
        """Before an upload: free the numbers dead uploads took, so the new version gets the lowest."""
        self._sweep_keys(f"{tenant}/{name}/", self._adapter_times(tenant, name))

    def _sweep_keys(self, prefix: str, keys: dict[str, float]) -> int:
        """Remove what `sweepable` picks among one adapter's keys; a failed removal is logged, not raised
        (the next sweep tries again)."""
        stale = sweepable(scan_versions(keys), self.clock(), self.config.stale_upload_s)
        for version, filenames in stale:
            try:
                for filename in filenames:
                    key = f"{prefix}{version}/{filename}"
                    self._call(f"sweep {key}", lambda k=key: self._remove(k))
            except StoreError as exc:
                log.warning("could not sweep %s%d/: %s", prefix, version, exc)
            else:
                log.info("swept %s%d/ (%s)", prefix, version, ", ".join(filenames))
        return len(stale)

    def _read_manifest(self, tenant: str, name: str, version: int) -> AdapterRecord | None:
        key = _version_prefix(tenant, name, version) + MANIFEST_FILE
        try:
            data = self._call(f"read {key}", lambda: self._read(key))
            record = AdapterRecord.from_json(data)
        except MissingKey:
            return None
        except ValueError as exc:
            log.warning("ignoring %s: %s", key, exc)
            return None
        if (record.name, record.version) != (name, version):
            log.warning("ignoring %s: it describes %s", key, record.ref)
            return None
        return record

    def _download(self, tenant: str, record: AdapterRecord, filename: str, dest: Path, limit: int) -> None:
        key = _version_prefix(tenant, record.name, record.version) + filename
        part = dest / f".{filename}.part"

        def once() -> tuple[int, str]:
            part.unlink(missing_ok=True)  # a retry starts afresh
            if self._link(key, part):  # no copy: the file is hashed where it lies, once (link_digests.py)
                if part.stat().st_size > limit:
                    raise ChecksumError(_mismatch(tenant, record, filename, f"is larger than {limit} bytes"))
                return self._link_digests.sha256(part)
            with self._open(key) as body, open(part, "wb") as out:
                return _stream(body, out.write, limit, tenant, record, filename)

        try:
            _check_download(tenant, record, filename, *self._call(f"download {key}", once))
        except MissingKey:
            part.unlink(missing_ok=True)
            raise AdapterNotFound(f"adapter {record.ref} was deleted while it was being fetched") from None
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest / filename)

    # Whether a disk-cache miss should read the version into memory (`read_record`) rather than through
    # a file: where the bytes cross a network (S3). A local store links its files into the cache instead,
    # which copies nothing.
    streams_to_memory = False

    def read_record(self, tenant: str, record: AdapterRecord) -> tuple[bytes, bytearray]:
        """The version's adapter_config.json and adapter_model.safetensors in memory, streamed from the
        store and checked against `record` as `fetch_record` checks them (ChecksumError, AdapterNotFound),
        without writing a file. The weights come in a bytearray of exactly the manifest's size."""
        check_tenant(tenant)
        start = time.monotonic()
        config = self._download_bytes(tenant, record, CONFIG_FILE, MAX_CONFIG_BYTES)
        weights = self._download_bytes(tenant, record, WEIGHTS_FILE, record.size_bytes)
        self.metrics.fetch_seconds(time.monotonic() - start)
        return bytes(config), weights

    def _download_bytes(self, tenant: str, record: AdapterRecord, filename: str, limit: int) -> bytearray:
        key = _version_prefix(tenant, record.name, record.version) + filename
        weights = filename == WEIGHTS_FILE  # its size is known: one buffer, filled in place

        def once() -> bytearray:
            if not weights:
                buffer = bytearray()
                with self._open(key) as body:
                    size, sha256 = _stream(body, buffer.extend, limit, tenant, record, filename)
                return buffer
            buffer = bytearray(limit)
            position = 0

            def sink(chunk: bytes) -> None:
                nonlocal position
                buffer[position : position + len(chunk)] = chunk  # same length: filled in place
                position += len(chunk)

            with self._open(key) as body:
                size, sha256 = _stream(body, sink, limit, tenant, record, filename)
            _check_download(tenant, record, filename, size, sha256)
            return buffer

        try:
            return self._call(f"download {key}", once)
        except MissingKey:
            raise AdapterNotFound(f"adapter {record.ref} was deleted while it was being fetched") from None


def _version_prefix(tenant: str, name: str, version: int) -> str:
    return f"{tenant}/{name}/{version}/"


def _chunks(body: BinaryIO) -> Iterator[bytes]:
    while chunk := body.read(CHUNK_BYTES):
        yield chunk


def _stream(
    body: BinaryIO,
    sink: Callable[[bytes], object],
    limit: int,
    tenant: str,
    record: AdapterRecord,
    filename: str,
) -> tuple[int, str]:
    """Copy a stream into `sink`, hashing it; ChecksumError once more than `limit` bytes arrive."""
    digest, size = hashlib.sha256(), 0
    for chunk in _chunks(body):
        size += len(chunk)
        if size > limit:
            raise ChecksumError(_mismatch(tenant, record, filename, f"is larger than {limit} bytes"))
        digest.update(chunk)
        sink(chunk)
    return size, digest.hexdigest()


def _check_download(tenant: str, record: AdapterRecord, filename: str, size: int, sha256: str) -> None:
    """The weights must have the manifest's size and sha256 (the config is covered by neither)."""
    if filename == WEIGHTS_FILE and size != record.size_bytes:
        how = f"has {size} bytes, but its manifest says {record.size_bytes}"
        raise ChecksumError(_mismatch(tenant, record, filename, how))
    if filename == WEIGHTS_FILE and sha256 != record.sha256:
        how = f"has sha256 {sha256}, but its manifest says {record.sha256}"
        raise ChecksumError(_mismatch(tenant, record, filename, how))


def _mismatch(tenant: str, record: AdapterRecord, filename: str, how: str) -> str:
    return (
        f"{filename} of adapter {record.ref} (tenant {tenant}) {how}: the stored copy is corrupt or was "
        "modified; upload the adapter again"
    )


def _record(
    name: str,
    version: int,
    checked: CheckedAdapter,
    created_at: str,
    served_model: str | None,
    tool_call_parser: str | None = None,
) -> AdapterRecord:
    adapter = checked.adapter
    return AdapterRecord(
        name=name,
        version=version,
        rank=adapter.rank,
        alpha=adapter.alpha,
        target_modules=adapter.target_modules,
        base_model=recorded_base_model(adapter.base_model, served_model),
        sha256=checked.sha256,
        size_bytes=checked.size_bytes,
        created_at=created_at,
        tool_call_parser=tool_call_parser,
        format=adapter.format,
        vocab_modules=adapter.vocab_formats,
    )
