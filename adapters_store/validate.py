"""Validate a staged adapter folder against the base model, with the checks the engine runs on every load.

The content rules (peft_type, task_type, rank, DoRA and other features, bias, modules_to_save, target
modules, layers, tensor names and shapes, the weights' values) live in adapter_format so the store and the
engine can never disagree; this module runs them on the staged files, as the engine will run them on
every load (`map_peft_adapter`), and wraps their errors for the API.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from adapter_format.checkpoint import PeftAdapter, map_peft_adapter
from adapter_format.errors import AdapterError
from adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from adapter_format.model_shape import ModelShape
from adapter_format.vocab_modules import VocabModule
from adapters_store.errors import InvalidAdapter
from adapters_store.streams import sha256_file


@dataclass(frozen=True)
class CheckedAdapter:
    """A staged adapter that passed every check, with what its manifest needs."""

    adapter: PeftAdapter  # config summary and per-module ranks (no tensors kept)
    sha256: str  # of adapter_model.safetensors
    size_bytes: int


def check_folder(
    folder: Path, shape: ModelShape, max_lora_rank: int, vocab_modules_served: bool = False
) -> CheckedAdapter:
    """InvalidAdapter (with the engine's code) for the first failed check. Messages name files by their
    names only: the folder is the server's staging folder."""
    if not (Path(folder) / CONFIG_FILE).is_file():
        raise InvalidAdapter(
            f"the upload has no {CONFIG_FILE}; a PEFT adapter folder needs {CONFIG_FILE} (save_pretrained "
            "writes it)",
            "missing_config",
        )
    weights = Path(folder) / WEIGHTS_FILE
    if not weights.is_file():
        raise InvalidAdapter(
            f"the upload has no {WEIGHTS_FILE}; PEFT adapters are uploaded as adapter_config.json plus "
            f"{WEIGHTS_FILE} (save_pretrained writes both)",
            "missing_weights",
        )
    try:
        mapped = map_peft_adapter(
            folder, shape, max_lora_rank, label=WEIGHTS_FILE, vocab_modules_served=vocab_modules_served
        )
    except AdapterError as exc:
        raise InvalidAdapter.from_adapter_error(exc) from None
    # No tensors kept: the modules' ranks and kinds only.
    summary = replace(
        mapped,
        modules={},
        vocab={m: VocabModule(v.kind, v.rank, v.scale) for m, v in mapped.vocab.items()},
    )
    return CheckedAdapter(adapter=summary, sha256=sha256_file(weights), size_bytes=weights.stat().st_size)
