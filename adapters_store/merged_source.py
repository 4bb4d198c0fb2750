"""Merged adapters (a request's `merged_adapters`) as engine adapters of their own: ids and their folders.

The front end computes a merge once (loraserve/merges/) and writes it as a PEFT folder under the
merge directory, `<directory>/<tenant>/<key>`; its engine id is `tenant/merge+<key>`, where `key` is a
digest of the parts' `name@version`, weights, method and parameters. `+` is in no adapter name, so a
merge id never names a stored version, and the tenant is part of it as in every engine id (two tenants'
merges never share a slot or a KV prefix). `MergedAdapterSource` wraps the store's source: it loads a
merge id from its folder (through the same `read` as any adapter: validated and laid out in a CPU-tier
row, counted and evicted like any other adapter) and hands every other id to the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapter_format.checkpoint import load_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.files import WEIGHTS_FILE
from adapters_store.names import check_tenant

MERGE_MARK = "merge+"
_KEY = re.compile(r"[0-9a-f]{32}")


def format_merge_id(tenant: str, key: str) -> str:
    """The engine id of one tenant's merge; `key` is 32 lowercase hex digits."""
    check_tenant(tenant)
    if not _KEY.fullmatch(key):
        raise ValueError(f"merge key {key!r} must be 32 lowercase hex digits")
    return f"{tenant}/{MERGE_MARK}{key}"


def parse_merge_id(adapter_id: str) -> tuple[str, str] | None:
    """(tenant, key) of a merge id; None for any other id."""
    tenant, slash, rest = adapter_id.partition("/")
    if not slash or not rest.startswith(MERGE_MARK) or not _KEY.fullmatch(rest[len(MERGE_MARK) :]):
        return None
    return tenant, rest[len(MERGE_MARK) :]


def merge_folder(directory: Path, tenant: str, key: str) -> Path:
    return Path(directory) / tenant / key


class MergedAdapterSource:
    """The store's AdapterSource (`inner`) plus merge ids, read from `directory`. Pickles with its inner
    source (into loader processes); `drain`/`replay` pass through."""

    def __init__(self, inner: Any, directory: str | Path):
        self.inner = inner
        self.directory = Path(directory)

    def __getattr__(self, name: str) -> Any:  # drain, replay, shape, ... of the store's source
        if name in ("inner", "directory"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def resolve(self, ref: str) -> str:
        return ref if parse_merge_id(ref) is not None else self.inner.resolve(ref)

    def load(self, adapter_id: str, read: Callable[[Path], Any] | None = None) -> Any:
        merge = parse_merge_id(adapter_id)
        if merge is None:
            return self.inner.load(adapter_id, read)
        folder = merge_folder(self.directory, *merge)
        if not (folder / WEIGHTS_FILE).is_file():
            raise AdapterError(
                "unknown_adapter",
                f"merged adapter {adapter_id!r} is not on this replica; send the request again",
            )
        if read is None:
            return load_peft_adapter(folder, self.inner.shape, self.inner.max_lora_rank, label=adapter_id)
        return read(folder)
