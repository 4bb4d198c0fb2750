"""The adapter store as the engine's AdapterSource: ids `tenant/name@version`, loads through the disk cache.

`resolve` only checks the id's syntax (it runs on the engine thread for every request, so it does no
I/O); whether the version exists is learnt by `load`, on a worker thread, where every store error
becomes an AdapterError that names the adapter and the cause, so only that adapter's requests fail.
The tenant is part of the id, so two tenants' adapters of one name never share a slot or a KV prefix;
versions are never reused, so an id always means the same bytes (hot swap is a new id).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapters_store.base import AdapterStore
from adapters_store.cache import DiskCache
from adapters_store.errors import AdapterNotFound, InvalidName, StoreError
from adapters_store.names import check_name, check_tenant, check_version, format_ref, parse_ref
from engine.lora.manager import Observer, emit
from engine.lora.model_shape import ModelShape
from engine.lora.peft_checkpoint import AdapterError, load_peft_adapter

_ID_FORM = "tenant/name@version, e.g. acme/support-bot@3"


def format_adapter_id(tenant: str, name: str, version: int) -> str:
    """The engine's id of one committed adapter version of one tenant (names checked)."""
    check_tenant(tenant)
    check_name(name)
    check_version(version)
    return f"{tenant}/{format_ref(name, version)}"


def parse_adapter_id(adapter_id: str) -> tuple[str, str, int]:
    """`tenant/name@version` -> (tenant, name, version); InvalidName (a ValueError) names what is wrong."""
    if not isinstance(adapter_id, str):
        raise InvalidName(f"adapter id must be a string (got {type(adapter_id).__name__})")
    tenant, sep, ref = adapter_id.partition("/")
    if not sep:
        raise InvalidName(f"adapter id {adapter_id!r} has no tenant; use {_ID_FORM}")
    check_tenant(tenant)
    name, version = parse_ref(ref)
    if version is None:
        raise InvalidName(f"adapter id {adapter_id!r} has no version; use {_ID_FORM}")
    return tenant, name, version


class StoreAdapterSource:
    """Adapters of every tenant, from the store through the local disk cache.

    `observer` (the engine's adapter observer) learns, per load, whether the disk cache held the
    adapter ("hit"/"miss", tier "disk"), the download seconds ("load", "store") and the seconds to read
    the cached folder into the CPU tier ("load", "disk": the engine's reader, a loader process on CUDA).
    It is called on worker threads.
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
            record = self.store.get(tenant, name, version)
            started = time.perf_counter()
            with self.disk_cache.checkout(tenant, record) as cached:
                self._emit("hit" if cached.hit else "miss", "disk")
                if not cached.hit:
                    self._emit("load", "store", time.perf_counter() - started)
                started = time.perf_counter()
                if read is None:
                    loaded = load_peft_adapter(cached.path, self.shape, self.max_lora_rank)
                else:
                    loaded = read(cached.path)
                self._emit("load", "disk", time.perf_counter() - started)
        except AdapterNotFound as exc:
            raise AdapterError("unknown_adapter", f"adapter {adapter_id!r} does not exist: {exc}") from None
        except StoreError as exc:
            raise AdapterError(
                exc.code, f"adapter {adapter_id!r} could not be fetched from the store: {exc}"
            ) from None
        except AdapterError as exc:
            raise AdapterError(exc.code, f"adapter {adapter_id!r} cannot be served: {exc}") from None
        except OSError as exc:  # the disk cache's folder: full disk, permissions
            raise AdapterError(
                "load_failed", f"adapter {adapter_id!r} could not be cached on local disk: {exc}"
            ) from None
        return loaded

    def _emit(self, event: str, tier: str, seconds: float = 0.0) -> None:
        emit(self._observer, event, tier, seconds)
