"""Adapters the engine knows: names bound to local PEFT folders, loaded and validated on first use.

This is the embedded, synchronous source of adapters; the adapter manager of `adapters_store` (S3,
disk and CPU tiers, background loads) plugs in at the same seam: `resolve` returns an adapter id and
the validated weights on the CPU.
"""

from __future__ import annotations

import threading
from pathlib import Path

from engine.lora.model_shape import ModelShape
from engine.lora.peft_checkpoint import AdapterError, PeftAdapter, load_peft_adapter


class AdapterRegistry:
    def __init__(self, shape: ModelShape, max_lora_rank: int):
        self.shape = shape
        self.max_lora_rank = max_lora_rank
        self._paths: dict[str, Path] = {}
        self._loaded: dict[str, PeftAdapter] = {}
        self._lock = threading.Lock()

    def register(self, name: str, path: str | Path) -> PeftAdapter:
        """Bind `name` to a PEFT folder, validating it now so a bad adapter fails at registration."""
        if not name or "/" in name:
            raise AdapterError("bad_name", f"adapter name {name!r} must be non-empty and contain no '/'")
        adapter = load_peft_adapter(path, self.shape, self.max_lora_rank)
        with self._lock:
            self._paths[name] = Path(path).resolve()
            self._loaded[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        with self._lock:
            self._paths.pop(name, None)
            self._loaded.pop(name, None)

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    def resolve(self, ref: str) -> tuple[str, PeftAdapter]:
        """(adapter id, weights) for a registered name or a local PEFT folder path."""
        with self._lock:
            if ref in self._loaded:
                return ref, self._loaded[ref]
        path = Path(ref).expanduser()
        if not path.is_dir():
            known = ", ".join(self.names) or "none registered"
            raise AdapterError("unknown_adapter", f"unknown adapter {ref!r} (known adapters: {known})")
        adapter_id = str(path.resolve())
        with self._lock:
            cached = self._loaded.get(adapter_id)
        if cached is None:
            cached = load_peft_adapter(path, self.shape, self.max_lora_rank)
            with self._lock:
                self._loaded[adapter_id] = cached
        return adapter_id, cached
