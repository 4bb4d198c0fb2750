"""Merged adapters (a request's `merged_adapters`) as engine adapters of their own: ids and their folders.

The front end computes a merge once (loraserve/merges/) and writes it as a PEFT folder under the
merge directory, `<directory>/<tenant>/<key>`; its engine id is `tenant/merge+<key>`, where `key` is a
digest of the parts' `name@version`, weights, method and parameters (the id's syntax, and why it never
names a stored version: adapter_format/names.py). `MergedAdapterSource` wraps the store's source: it loads a
merge id from its folder (through the same `read` as any adapter: validated and laid out in a CPU-tier
row, counted and evicted like any other adapter) and hands every other id to the store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapter_format.checkpoint import load_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.files import WEIGHTS_FILE
from adapter_format.names import parse_merge_id


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
