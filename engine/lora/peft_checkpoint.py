"""Read and validate PEFT LoRA checkpoints (adapter_config.json + adapter_model.safetensors).

Validation works on tensor names and shapes alone (`check_adapter`), so the adapter store can run it
on a safetensors header before writing anything; `load_peft_adapter` then reads the tensors.
Only safetensors is read: pickled `.bin` checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.lora.model_shape import ATTENTION_MODULES, TARGET_MODULES, ModelShape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (any prefix before `layers.`).
_TENSOR_NAME = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+?)\.lora_(?P<ab>[AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter the engine cannot serve; `code` names the failed check for callers and APIs."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # raised in a loader process, re-raised in the engine's: keep the code
        return type(self), (self.code, str(self))


@dataclass(frozen=True)
class ModuleLoRA:
    """One projection's low-rank pair in one layer."""

    rank: int
    scale: float  # PEFT's scaling: alpha / r, or alpha / sqrt(r) with use_rslora
    lora_a: torch.Tensor | None = None  # [rank, in]
    lora_b: torch.Tensor | None = None  # [out, rank]


@dataclass(frozen=True)
class PeftAdapter:
    """A validated adapter: its config summary and its modules keyed by (layer, projection)."""

    rank: int  # the largest rank over its modules
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    modules: dict[tuple[int, str], ModuleLoRA]


def check_adapter_config(config: Mapping, max_lora_rank: int) -> None:
    """Refuse adapter configs the engine cannot serve faithfully."""
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise AdapterError(
            "not_lora", f"peft_type is {config.get('peft_type')!r}; only LORA adapters are supported"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError("bad_rank", f"adapter_config.json: r must be a positive integer (got {rank!r})")
    ranks = [rank, *dict(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_lora_rank:
        raise AdapterError(
            "rank_too_large",
            f"adapter rank {max(ranks)} exceeds max_lora_rank {max_lora_rank}; start the server with a larger "
            "--max-lora-rank or retrain with a smaller r",
        )
    if config.get("use_dora"):
        raise AdapterError("dora_unsupported", "DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(
            "bias_unsupported", "adapters that train biases (bias != 'none') are not supported"
        )
    if config.get("modules_to_save"):
        raise AdapterError(
            "modules_to_save_unsupported",
            f"modules_to_save ({config['modules_to_save']}) is not supported: only LoRA pairs can be served",
        )
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out_unsupported", "fan_in_fan_out adapters are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unsupported = sorted(set(targets) - set(TARGET_MODULES))
        if unsupported:
            raise AdapterError(
                "unsupported_target",
                f"target modules {unsupported} are not supported; LoRA may target {', '.join(TARGET_MODULES)}",
            )


def check_adapter(
    config: Mapping,
    tensor_shapes: Mapping[str, tuple[int, ...]],
    shape: ModelShape,
    max_lora_rank: int,
) -> PeftAdapter:
    """Validate a config and its tensors' names and shapes against the base model (no tensor data read)."""
    check_adapter_config(config, max_lora_rank)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for name, tensor_shape in tensor_shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(
                "unexpected_tensor",
                f"tensor {name!r} is not a LoRA weight of a decoder-layer projection "
                f"({', '.join(TARGET_MODULES)}); embedding, lm_head, bias and DoRA tensors are not supported",
            )
        layer, module = int(match["layer"]), match["module"]
        if module not in TARGET_MODULES:
            raise AdapterError(
                "unsupported_target",
                f"tensor {name!r} targets {module!r}; supported: {', '.join(TARGET_MODULES)}",
            )
        if layer >= shape.num_layers:
            raise AdapterError(
                "layer_out_of_range",
                f"tensor {name!r} is for layer {layer}, but the base model has {shape.num_layers}",
            )
        pairs.setdefault((layer, module), {})[match["ab"]] = tuple(tensor_shape)
    if not pairs:
        raise AdapterError("no_lora_weights", "adapter_model.safetensors holds no LoRA weights")

    alpha = float(config.get("lora_alpha", 8))
    modules: dict[tuple[int, str], ModuleLoRA] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(
                "incomplete_pair", f"layer {layer} {module}: lora_A and lora_B must both be present"
            )
        in_features, out_features = shape.module_dims(module)
        rank = ab["A"][0]
        expected_a, expected_b = (rank, in_features), (out_features, rank)
        if ab["A"] != expected_a or ab["B"] != expected_b:
            raise AdapterError(
                "shape_mismatch",
                f"layer {layer} {module}: lora_A {list(ab['A'])} / lora_B {list(ab['B'])} do not fit the base "
                f"model, which needs {list(expected_a)} / {list(expected_b)}; was the adapter trained on another model?",
            )
        if rank > max_lora_rank:
            raise AdapterError(
                "rank_too_large",
                f"layer {layer} {module} has rank {rank}, above max_lora_rank {max_lora_rank}",
            )
        modules[(layer, module)] = ModuleLoRA(rank=rank, scale=_scaling(config, layer, module, rank, alpha))
    targets = tuple(sorted({module for _, module in modules}, key=TARGET_MODULES.index))
    return PeftAdapter(
        rank=max(m.rank for m in modules.values()),
        alpha=alpha,
        target_modules=targets,
        base_model=config.get("base_model_name_or_path"),
        modules=modules,
    )


def _scaling(config: Mapping, layer: int, module: str, rank: int, alpha: float) -> float:
    """PEFT's per-module scaling, honouring alpha_pattern and use_rslora."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    key = f"model.layers.{layer}.{block}.{module}"
    alpha_pattern = dict(config.get("alpha_pattern") or {})
    if alpha_pattern:
        from peft.utils.other import get_pattern_key  # PEFT's own matching; imported only when needed (slow)

        matched = get_pattern_key(alpha_pattern.keys(), key)
        alpha = float(alpha_pattern.get(matched, alpha))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_adapter_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(
            "missing_config", f"{path} does not exist: a PEFT adapter folder needs {CONFIG_FILE}"
        )
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError("bad_config", f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError("bad_config", f"{path} must hold a JSON object")
    return config


def load_peft_adapter(folder: str | Path, shape: ModelShape, max_lora_rank: int) -> PeftAdapter:
    """Read, validate and load a PEFT adapter folder onto the CPU (weights in their stored dtype)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError("not_found", f"adapter folder {folder} does not exist")
    config = read_adapter_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = [p.name for p in folder.glob("*.bin")]
        hint = (
            f" (found {pickled}: pickled checkpoints are never loaded; convert to safetensors)"
            if pickled
            else ""
        )
        raise AdapterError("missing_weights", f"{weights} does not exist{hint}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            adapter = check_adapter(config, shapes, shape, max_lora_rank)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises several types for corrupt headers
        raise AdapterError("bad_weights", f"{weights} is not a readable safetensors file: {exc}") from None
    loaded: dict[tuple[int, str], ModuleLoRA] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        key = (int(match["layer"]), match["module"])
        loaded.setdefault(key, {})[match["ab"]] = tensor  # as stored; the slot image converts it once
    modules = {
        key: ModuleLoRA(rank=m.rank, scale=m.scale, lora_a=loaded[key]["A"], lora_b=loaded[key]["B"])
        for key, m in adapter.modules.items()
    }
    return PeftAdapter(adapter.rank, adapter.alpha, adapter.target_modules, adapter.base_model, modules)
