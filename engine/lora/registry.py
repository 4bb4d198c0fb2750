"""Adapters from local PEFT folders: names bound to folders, or folder paths used directly.

The embedded `AdapterSource`; the adapter store plugs in at the same seam (`resolve` a reference to an
adapter id, `load` it onto the CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adapter_format.checkpoint import PeftAdapter, load_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.model_shape import ModelShape


class AdapterRegistry:
    def __init__(self, shape: ModelShape, max_lora_rank: int, vocab_modules_served: bool = False):
        """`vocab_modules_served`: adapters with their own embedding or LM head are taken (the engine has
        room for them: max_vocab_loras)."""
        self.shape = shape
        self.max_lora_rank = max_lora_rank
        self.vocab_modules_served = vocab_modules_served
        self._paths: dict[str, Path] = {}  # adapter id -> folder
        # name -> its current adapter id; registering a name again gives it a new id ("name~2"), so
        # requests already running keep the weights they started with.
        self._current: dict[str, str] = {}
        self._generation: dict[str, int] = {}
        self._lock = threading.Lock()  # `load` may run on the manager's worker threads

    def __getstate__(self) -> dict:
        """Pickled with each job for a loader process: a copy of the folders bound so far (ids never
        change their folder, so the copy loads any id issued before it was made)."""
        with self._lock:
            state = dict(self.__dict__, _paths=dict(self._paths), _current=dict(self._current))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def register(self, name: str, path: str | Path) -> PeftAdapter:
        """Bind `name` to a PEFT folder, validating it now so a bad adapter fails at registration."""
        if not name or "/" in name or "~" in name:
            raise AdapterError("bad_name", f"adapter name {name!r} must be non-empty, without '/' or '~'")
        adapter = load_peft_adapter(
            path, self.shape, self.max_lora_rank, vocab_modules_served=self.vocab_modules_served
        )
        with self._lock:
            generation = self._generation.get(name, 0) + 1
            self._generation[name] = generation
            adapter_id = name if generation == 1 else f"{name}~{generation}"
            self._paths[adapter_id] = Path(path).resolve()
            self._current[name] = adapter_id
        return adapter

    def unregister(self, name: str) -> None:
        """New requests can no longer name it; running ones finish."""
        with self._lock:
            self._current.pop(name, None)

    def current(self, name: str) -> str | None:
        """The adapter id a registered name serves now, or None."""
        with self._lock:
            return self._current.get(name)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._current)

    def resolve(self, ref: str) -> str:
        """The adapter id of a registered name or of a local PEFT folder path."""
        with self._lock:
            if ref in self._current:
                return self._current[ref]
        path = Path(ref).expanduser()
        if not path.is_dir():
            known = ", ".join(self.names) or "none registered"
            raise AdapterError("unknown_adapter", f"unknown adapter {ref!r} (known adapters: {known})")
        adapter_id = str(path.resolve())
        with self._lock:
            self._paths[adapter_id] = path.resolve()
        return adapter_id

    def load(self, adapter_id: str, read: Callable[[Path], Any] | None = None) -> Any:
        """`read(folder)` for the adapter's folder; by default, the validated PeftAdapter."""
        with self._lock:
            path = self._paths.get(adapter_id)
        if path is None:
            raise AdapterError("unknown_adapter", f"unknown adapter {adapter_id!r}")
        if read is None:
            return load_peft_adapter(
                path, self.shape, self.max_lora_rank, vocab_modules_served=self.vocab_modules_served
            )
        return read(path)
