"""Load a Llama-family checkpoint (config.json + safetensors, sharded or not) from a folder or the hub."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig

from adapter_format.model_shape import TARGET_MODULES
from engine.model.fp8_checkpoint import DROPPED_NAMES, SCALE_NAMES, build_fp8_linear, fp8_scheme
from engine.model.fp8_linear import Fp8Linear
from engine.model.kv_quant import FP8_DTYPE, default_scale
from engine.model.llama import LayerWeights, ModelWeights
from engine.model.weight_source import open_checkpoint

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
# fp8 KV-cache scales under `model.layers.N.self_attn.`, as vLLM reads them: llm-compressor's and
# vLLM's own names, ModelOpt's, AutoFP8's output scales of k_proj/v_proj, and the older single kv_scale.
_K_SCALE_NAMES = ("k_scale", "attn.k_scale", "k_proj.k_scale", "k_proj.output_scale", "kv_scale")
_V_SCALE_NAMES = ("v_scale", "attn.v_scale", "v_proj.v_scale", "v_proj.output_scale", "kv_scale")
_SCALE_SUFFIXES = tuple(f".self_attn.{n}" for n in {*_K_SCALE_NAMES, *_V_SCALE_NAMES})
# The projections FP8 applies to (LoRA's seven), and the float32 tensors a quantized checkpoint keeps
# beside their weights.
_PROJECTION_WEIGHTS = tuple(f"{m}.weight" for m in TARGET_MODULES)
_WEIGHT_SCALE_SUFFIXES = tuple(f"{m}.{n}" for m in TARGET_MODULES for n in (*SCALE_NAMES, *DROPPED_NAMES))


def resolve_model_path(model: str) -> Path:
    """A local folder as is; anything else is a hub id, downloaded through huggingface_hub's cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} is not a folder holding config.json and safetensors weights")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS))


def load_config(path: Path):
    return AutoConfig.from_pretrained(str(path))


def checkpoint_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = [p.name for p in path.glob("*.bin")]
        hint = (
            f" (found {found}: pickled checkpoints are not loaded; convert them to safetensors)"
            if found
            else ""
        )
        raise ValueError(f"{path} holds no .safetensors weights{hint}")
    return files


def load_weights(
    path: Path,
    config,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    fp8_gemm: str = "auto",
    load_format: str = "auto",
) -> ModelWeights:
    """Read every shard once, fusing q/k/v and gate/up as the layers are completed.

    With FP8 (`quantization="fp8"`, or a checkpoint quantized in a supported FP8 format) the seven
    projections become `Fp8Linear`s (engine/model/fp8_checkpoint.py); everything else keeps `dtype`."""
    scheme = fp8_scheme(config, quantization)
    raw: dict[str, torch.Tensor] = {}
    for f in open_checkpoint(lambda: _weight_files(path), config, load_format, device, dtype):
        for name in f.keys():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            tensor = f.get_tensor(name)
            # Scales stay float32: rounded to bf16 they would be off by up to 0.4%.
            if name.endswith(_SCALE_SUFFIXES) or name.endswith(_WEIGHT_SCALE_SUFFIXES):
                raw[name] = tensor.to(torch.float32)
            elif tensor.dtype == FP8_DTYPE or (scheme and name.endswith(_PROJECTION_WEIGHTS)):
                raw[name] = tensor  # quantized below, from the checkpoint's own values
            else:
                raw[name] = tensor.to(dtype)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"checkpoint {path} lacks tensor {name!r}; is it a Llama-family model?")
        if raw[name].dtype == FP8_DTYPE:
            raise ValueError(
                f"checkpoint {path} stores {name!r} as float8 but config.json's quantization_config does "
                "not describe it (only the seven linear projections of a supported FP8 format are read)"
            )
        return raw.pop(name).to(device)

    def take_optional(name: str) -> torch.Tensor | None:
        return take(name) if name in raw else None

    def take_linear(prefixes: list[str]) -> torch.Tensor | Fp8Linear:
        """One projection, or several fused along the output dimension (q/k/v, gate/up)."""
        if scheme is None:
            weights = [take(f"{p}.weight") for p in prefixes]
            return weights[0] if len(weights) == 1 else torch.cat(weights)
        parts = []
        for p in prefixes:
            if f"{p}.weight" not in raw:
                take(f"{p}.weight")  # raises naming the tensor
            scales = [raw.pop(f"{p}.{n}") for n in SCALE_NAMES if f"{p}.{n}" in raw]
            for n in DROPPED_NAMES:
                raw.pop(f"{p}.{n}", None)
            parts.append((raw.pop(f"{p}.weight"), scales[0] if scales else None))
        return build_fp8_linear(prefixes[0], parts, device, fp8_gemm)

    def take_scale(layer: int, names: tuple[str, ...]) -> torch.Tensor | None:
        """The first of `names` present, all of them removed (kv_scale serves both K and V)."""
        found = [raw[n] for n in (f"model.layers.{layer}.self_attn.{m}" for m in names) if n in raw]
        for name in names:
            if name != "kv_scale":
                raw.pop(f"model.layers.{layer}.self_attn.{name}", None)
        if not found:
            return None
        scale = found[0]
        if scale.numel() != 1 or not torch.isfinite(scale).all() or scale.item() <= 0:
            raise ValueError(
                f"layer {layer}: the KV cache scale {names[0]} must be one positive number (per-tensor), "
                f"got shape {tuple(scale.shape)}"
            )
        return scale.reshape(1).to(device)

    layers = []
    num_scales = 0
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        k_scale, v_scale = take_scale(i, _K_SCALE_NAMES), take_scale(i, _V_SCALE_NAMES)
        raw.pop(f"{p}self_attn.kv_scale", None)
        num_scales += (k_scale is not None) + (v_scale is not None)
        biases = [take_optional(f"{p}self_attn.{m}_proj.bias") for m in "qkv"]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError(f"layer {i}: q/k/v biases must be all present or all absent")
        layers.append(
            LayerWeights(
                input_norm=take(f"{p}input_layernorm.weight"),
                qkv=take_linear([f"{p}self_attn.{m}_proj" for m in "qkv"]),
                qkv_bias=torch.cat(biases) if biases[0] is not None else None,
                o=take_linear([f"{p}self_attn.o_proj"]),
                post_norm=take(f"{p}post_attention_layernorm.weight"),
                gate_up=take_linear([f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]),
                down=take_linear([f"{p}mlp.down_proj"]),
                k_scale=default_scale(device) if k_scale is None else k_scale,
                v_scale=default_scale(device) if v_scale is None else v_scale,
            )
        )
    embed = take("model.embed_tokens.weight")
    norm = take("model.norm.weight")
    lm_head = take_optional("lm_head.weight")
    if lm_head is None or getattr(config, "tie_word_embeddings", False):
        lm_head = embed
    if raw:
        raise ValueError(f"checkpoint {path} has tensors this model does not use: {sorted(raw)[:5]}")
    if scheme is not None:
        gemms = sorted({w.gemm for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)})
        logger.info("FP8 weights: %s, GEMM %s", scheme, ", ".join(gemms))
    return ModelWeights(
        embed=embed,
        layers=layers,
        norm=norm,
        lm_head=lm_head,
        kv_scales_from_checkpoint=num_scales > 0,
        quantization=scheme,
    )
