"""The adapter store as the engine's AdapterSource: ids `tenant/name@version` (adapter_format/names.py), loads
through the disk cache.

`resolve` only checks the id's syntax (it runs on the engine thread for every request, so it does no
I/O); whether the version exists is learnt by `load`, in the background, where every store error
becomes an AdapterError that names the adapter and the cause, so only that adapter's requests fail.
The tenant is part of the id, so two tenants' adapters of one name never share a slot or a KV prefix;
versions are never reused, so an id always means the same bytes (hot swap is a new id).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from adapter_format.checkpoint import load_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.events import Observer, emit
from adapter_format.files import WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapter_format.names import parse_adapter_id
from adapters_store.base import AdapterStore
from adapters_store.cache import DiskCache
from adapters_store.errors import AdapterNotFound, ChecksumError, DiskFull, StoreError
from adapters_store.metrics import RecordingMetrics, replay_metrics
from adapters_store.record import AdapterRecord

log = logging.getLogger(__name__)
# Streamed loads whose disk-cache write may wait at once (each holds its adapter's bytes meanwhile).
MAX_PENDING_FILLS = 4


class StoreAdapterSource:
    """Adapters of every tenant, from the store through the local disk cache.

    `observer` (the engine's adapter observer) learns, per load, whether the disk cache held the
    adapter ("hit"/"miss", tier "disk"), the download seconds ("load", "store") and the seconds to read
    the cached folder into the CPU tier ("load", "disk"). It is called on worker threads.

    A disk-cache miss on a store whose bytes cross a network (S3: `AdapterStore.streams_to_memory`)
    does not wait for the disk: when the caller's `read` can take the files from memory (the engine's
    RowReader), the two files stream into memory, checked against the manifest as they come, the
    adapter is laid out from there, and the disk cache is written behind the load on a thread of its
    own. Elsewhere (a local store links its files into the cache, or `read` wants a folder) the load
    goes through the disk cache as before.

    On CUDA the engine runs whole loads in its loader processes (engine/lora/background_loads.py): the
    source pickles into a recipe (the store, the disk cache's directory and budget, the shape), which
    each process builds once and keeps. There, the observer's events and the store's and cache's
    metrics are recorded (`drain`), and `replay` hands them to this source's observer and metrics.
    """

    def __init__(
        self,
        store: AdapterStore,
        disk_cache: DiskCache,
        shape: ModelShape,
        max_lora_rank: int,
        observer: Observer | None = None,
    ):
        self.store = store
        self.disk_cache = disk_cache
        self.shape = shape
        self.max_lora_rank = max_lora_rank
        self._observer = observer
        self._records: list | None = None  # a loader process's copy records here instead of observing
        self._recipe: bytes | None = None
        # Disk-cache writes behind streamed loads (`_fill_behind`): one thread, started on first use.
        self._filler: ThreadPoolExecutor | None = None
        self._fill_lock = threading.Lock()
        self._pending_fills = 0

    def __reduce__(self):
        if self._recipe is None:  # pickled once, sent with every job
            cache = self.disk_cache
            recipe = (
                self.store,
                str(cache.directory),
                cache.max_bytes,
                cache.min_free_bytes,
                self.shape,
                self.max_lora_rank,
            )
            self._recipe = pickle.dumps(recipe)
        return _loader_copy, (self._recipe,)

    def drain(self) -> list:
        """In a loader process: what the observer and metrics saw since the last call."""
        if self._records is None:
            return []
        count = len(self._records)
        records = self._records[:count]
        # In place (the store's and cache's RecordingMetrics append to this list), and in one operation, so
        # a record appended meanwhile by a loader thread (the engine core's own loads) stays for next time.
        del self._records[:count]
        return records

    def replay(self, records: list) -> None:
        """In the serving process: a loader process's records onto this source's observer and metrics."""
        for hook, args in records:
            if hook == "event":
                self._emit(*args)
            else:
                replay_metrics(hook, args, self.store.metrics, self.disk_cache.metrics)

    def resolve(self, ref: str) -> str:
        """Check the id's syntax; no I/O (a missing version fails its requests when `load` runs)."""
        try:
            parse_adapter_id(ref)
        except ValueError as exc:
            raise AdapterError("unknown_adapter", f"unknown adapter {ref!r}: {exc}") from None
        return ref

    def load(self, adapter_id: str, read: Callable[[Path], Any] | None = None) -> Any:
        """Read the manifest, fetch through the disk cache, and return `read(folder)` with the cached folder
        pinned; by default, the validated PeftAdapter."""
        tenant, name, version = parse_adapter_id(adapter_id)
        try:
            # On local disk already: no store call, so such loads work while the store is down.
            record = self.disk_cache.cached_record(tenant, name, version)
            if record is None:
                record = self.store.get(tenant, name, version)
                from_memory = getattr(read, "from_memory", None)
                if from_memory is not None and self.store.streams_to_memory:
                    if not self.disk_cache.holds(tenant, record):
                        return self._load_streamed(tenant, record, read)
            started = time.perf_counter()
            with self.disk_cache.checkout(tenant, record) as cached:
                self._emit("hit" if cached.hit else "miss", "disk")
                if not cached.hit:
                    self._emit("load", "store", time.perf_counter() - started)
                    _came_from(read, "store")
                started = time.perf_counter()
                if read is None:
                    loaded = load_peft_adapter(cached.path, self.shape, self.max_lora_rank)
                else:
                    loaded = read(cached.path)
                self._emit("load", "disk", time.perf_counter() - started)
        # Messages reach the client: they name the adapter and what to do, never an endpoint, bucket or
        # local path; the log has the details.
        except AdapterNotFound as exc:
            raise AdapterError("unknown_adapter", f"adapter {adapter_id!r} does not exist: {exc}") from None
        except DiskFull as exc:  # the cache evicted all it could: this replica's disk, not the store
            raise AdapterError(exc.code, f"adapter {adapter_id!r} could not be loaded: {exc}") from None
        except ChecksumError as exc:  # names only the adapter and its sha256
            raise AdapterError(
                exc.code, f"adapter {adapter_id!r} could not be fetched from the store: {exc}"
            ) from None
        except StoreError as exc:
            log.warning("adapter %s could not be fetched from the store: %s", adapter_id, exc)
            raise AdapterError(
                exc.code,
                f"adapter {adapter_id!r} could not be fetched from the store: it is unavailable; retry later",
            ) from None
        except AdapterError as exc:
            log.warning("adapter %s cannot be served: %s", adapter_id, exc)
            message = str(exc).replace(str(self.disk_cache.directory), "<cache>")
            raise AdapterError(exc.code, f"adapter {adapter_id!r} cannot be served: {message}") from None
        except OSError as exc:  # the disk cache's folder: full disk, permissions
            log.error("adapter %s could not be cached on local disk: %s", adapter_id, exc)
            raise AdapterError(
                "load_failed",
                f"adapter {adapter_id!r} could not be loaded: a server-side disk error; retry later",
            ) from None
        return loaded

    def _load_streamed(self, tenant: str, record: AdapterRecord, read) -> Any:
        """A disk-cache miss on a remote store: the files stream into memory and the adapter is laid out
        from there, with no temporary file on the way; the disk cache is filled behind, on a thread of
        its own, so the load does not wait for the write (a later load of it then hits the cache)."""
        started = time.perf_counter()
        config, weights = self.store.read_record(tenant, record)
        self.disk_cache.metrics.cache_miss()
        self._emit("miss", "disk")
        self._emit("load", "store", time.perf_counter() - started)
        read.came_from("store")
        loaded = read.from_memory(config, weights, WEIGHTS_FILE)
        self._fill_behind(tenant, record, config, weights)
        return loaded

    def _fill_behind(self, tenant: str, record: AdapterRecord, config: bytes, weights: bytearray) -> None:
        """Write a streamed version into the disk cache in the background; skipped (the next load streams
        it again) while MAX_PENDING_FILLS writes wait, so memory held for them stays bounded."""
        with self._fill_lock:
            if self._pending_fills >= MAX_PENDING_FILLS:
                log.debug(
                    "disk cache fill of %s/%s skipped: %d writes pending",
                    tenant,
                    record.ref,
                    MAX_PENDING_FILLS,
                )
                return
            self._pending_fills += 1
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="disk-cache-fill")
        self._filler.submit(self._fill, tenant, record, config, weights)

    def _fill(self, tenant: str, record: AdapterRecord, config: bytes, weights: bytearray) -> None:
        try:
            self.disk_cache.insert(tenant, record, config, weights)
        except Exception as exc:  # the load succeeded already: a full disk only costs a later download
            log.warning("adapter %s/%s was not written to the disk cache: %s", tenant, record.ref, exc)
        finally:
            with self._fill_lock:
                self._pending_fills -= 1

    def wait_for_fills(self, timeout: float = 30.0) -> bool:
        """Block until the disk-cache writes queued so far are done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._fill_lock:
                if self._pending_fills == 0:
                    return True
            time.sleep(0.01)
        return False

    def _emit(self, event: str, tier: str, seconds: float = 0.0) -> None:
        if self._records is not None:
            self._records.append(("event", (event, tier, seconds)))
        else:
            emit(self._observer, event, tier, seconds)


def _came_from(read, origin: str) -> None:
    """Tell a reader that can hear it (engine/lora/background_loads.RowReader) where the adapter was."""
    came_from = getattr(read, "came_from", None)
    if came_from is not None:
        came_from(origin)


_LOADER_COPIES: dict[bytes, StoreAdapterSource] = {}  # in a loader process: one source per recipe


def _loader_copy(recipe: bytes) -> StoreAdapterSource:
    """The source a recipe describes, built once per process: its own store client, the shared disk cache."""
    source = _LOADER_COPIES.get(recipe)
    if source is None:
        store, directory, max_bytes, min_free_bytes, shape, max_lora_rank = pickle.loads(recipe)
        records: list = []
        store.metrics = RecordingMetrics(records)
        cache = DiskCache(store, directory, max_bytes, min_free_bytes=min_free_bytes)
        source = StoreAdapterSource(store, cache, shape, max_lora_rank)
        source._records = records
        _LOADER_COPIES[recipe] = source
    return source
