"""The safetensors header check (engine.lora.safetensors_header) as the store raises it: InvalidAdapter."""

from __future__ import annotations

from pathlib import Path

from adapters_store.errors import InvalidAdapter
from engine.lora import safetensors_header
from engine.lora.adapter_error import AdapterError


def read_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the header of `path`; InvalidAdapter('bad_weights') if malformed."""
    try:
        return safetensors_header.read_tensor_shapes(path)
    except AdapterError as exc:
        raise InvalidAdapter.from_adapter_error(exc) from None
