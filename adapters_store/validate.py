"""Validate a staged adapter folder against the base model, with the checks the engine runs on every load.

The content rules (peft_type, rank, DoRA, bias, modules_to_save, target modules, tensor names,
layer range, shapes) live in adapter_format (checkpoint.check_adapter) so the store and the engine
can never disagree; this module only feeds it a config and the tensor shapes from the header.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapter_format.checkpoint import PeftAdapter, check_adapter
from adapter_format.errors import AdapterError
from adapter_format.files import WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapter_format.peft_config import read_adapter_config
from adapter_format.safetensors_header import read_tensor_shapes
from adapters_store.errors import InvalidAdapter
from adapters_store.streams import sha256_file


@dataclass(frozen=True)
class CheckedAdapter:
    """A staged adapter that passed every check, with what its manifest needs."""

    adapter: PeftAdapter  # config summary and per-module ranks (no tensors loaded)
    sha256: str  # of adapter_model.safetensors
    size_bytes: int


def check_folder(folder: Path, shape: ModelShape, max_lora_rank: int) -> CheckedAdapter:
    """InvalidAdapter (with the engine's code) for the first failed check; reads no tensor data."""
    try:
        config = read_adapter_config(folder)
    except AdapterError as exc:
        raise InvalidAdapter.from_adapter_error(exc) from None
    weights = Path(folder) / WEIGHTS_FILE
    if not weights.is_file():
        raise InvalidAdapter(
            f"the upload has no {WEIGHTS_FILE}; PEFT adapters are uploaded as adapter_config.json plus "
            f"{WEIGHTS_FILE} (save_pretrained writes both)",
            "missing_weights",
        )
    try:
        adapter = check_adapter(config, read_tensor_shapes(weights), shape, max_lora_rank)
    except AdapterError as exc:
        raise InvalidAdapter.from_adapter_error(exc) from None
    return CheckedAdapter(adapter=adapter, sha256=sha256_file(weights), size_bytes=weights.stat().st_size)
