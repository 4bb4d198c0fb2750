"""FP8 checkpoints written the way llm-compressor and the Qwen/DeepSeek FP8 releases lay them out, from a
float checkpoint, quantized here (not by the engine's code), plus the float checkpoint that holds exactly
the values an FP8 checkpoint stands for (its "dequantized equivalent")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    *("w1", "w2", "w3"),  # Mixtral's per-expert gate, down and up
)


def is_projection(name: str) -> bool:
    return any(name.endswith(f".{m}.weight") for m in PROJECTIONS)


def e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w / scale, saturated at +-448, rounded to e4m3 (scale broadcast against w)."""
    return (w.double() / scale.double()).clamp(-E4M3_MAX, E4M3_MAX).float().to(E4M3)


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # q [out, in], scale [out, 1]
    scale = w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return e4m3(w, scale), scale


def per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # q [out, in], scale [] (one number)
    scale = w.float().abs().max() / E4M3_MAX
    return e4m3(w, scale), scale


def block_scales_full(scale: torch.Tensor, shape) -> torch.Tensor:  # [nb, kb] -> [out, in]
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]


def per_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # q [out, in], scale_inv [nb, kb]
    out_features, in_features = w.shape
    nb, kb = -(-out_features // 128), -(-in_features // 128)
    scale = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            scale[i, j] = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max() / E4M3_MAX
    return e4m3(w, block_scales_full(scale, w.shape)), scale


def _copy_with(src: Path, dst: Path, tensors: dict, quantization_config: dict | None) -> Path:
    shutil.copytree(src, dst)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def compressed_tensors_group(strategy: str, activations: dict | None) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    return {"targets": ["Linear"], "weights": weights, "input_activations": activations, "format": None}


DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


def write_compressed_tensors(
    src: Path, dst: Path, strategy: str = "channel", scale_dtype=torch.bfloat16
) -> Path:
    """llm-compressor's FP8_DYNAMIC layout: `<proj>.weight` e4m3 [out, in], `<proj>.weight_scale` [out, 1]
    (channel) or one number (tensor); lm_head left in the model dtype."""
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if is_projection(name):
            q, scale = per_channel(w) if strategy == "channel" else per_tensor(w)
            # The scale as stored (bf16 rounds it); the values it stands for use the stored number.
            tensors[name] = q
            tensors[name.replace(".weight", ".weight_scale")] = scale.to(scale_dtype)
        else:
            tensors[name] = w
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": compressed_tensors_group(strategy, DYNAMIC_TOKEN)},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    return _copy_with(src, dst, tensors, config)


def write_block_fp8(src: Path, dst: Path) -> Path:
    """The Qwen/DeepSeek FP8 layout: `<proj>.weight` e4m3, `<proj>.weight_scale_inv` float32 [nb, kb]."""
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if is_projection(name):
            q, scale = per_block(w)
            tensors[name] = q
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale
        else:
            tensors[name] = w
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    return _copy_with(src, dst, tensors, config)


def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The real values an FP8 tensor stands for, multiplied in float64 then rounded to float32."""
    scale = scale.double()
    if scale.numel() == 1:
        full = scale.reshape(1, 1)
    elif scale.shape in ((w.shape[0],), (w.shape[0], 1)):
        full = scale.reshape(-1, 1)
    else:
        full = block_scales_full(scale, w.shape)
    return (w.double() * full).float()


def write_dequantized(fp8_dir: Path, dst: Path) -> Path:
    """The float32 checkpoint holding exactly the values of `fp8_dir`'s FP8 projections, unquantized."""
    stored = load_file(fp8_dir / "model.safetensors")
    tensors = {}
    for name, t in stored.items():
        if is_projection(name):
            scale = next(stored[name + s] for s in ("_scale", "_scale_inv") if name + s in stored)
            tensors[name] = dequantized(t, scale.float())
        elif not name.endswith(("weight_scale", "weight_scale_inv")):
            tensors[name] = t
    shutil.copytree(fp8_dir, dst)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def fuse_fp8_experts(fp8_dir: Path, dst: Path) -> Path:
    """A per-expert FP8 MoE checkpoint in transformers 5's fused layout: `mlp.experts.gate_up_proj`
    [E, 2I, H] e4m3 with `gate_up_proj_scale_inv` [E, 2 nb(I), kb(H)] (gate's scale rows, then up's, as
    transformers stacks them) or [E, 2I, 1] per channel; `down_proj` [E, H, I] with `down_proj_scale_inv`."""
    shutil.copytree(fp8_dir, dst)
    tensors = load_file(dst / "model.safetensors")
    fused, parts = {}, {}
    for name, tensor in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." not in name:
            fused[name] = tensor
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, part, kind = rest.split(".")
        part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(part, part)
        kind = "weight" if kind == "weight" else "scale"
        parts.setdefault((prefix, part, kind), {})[int(expert)] = tensor
    for (prefix, part, kind), by_expert in parts.items():
        if part == "up_proj":
            continue
        order = sorted(by_expert)
        if part == "gate_proj":
            up = parts[(prefix, "up_proj", kind)]
            stacked = torch.stack([torch.cat([by_expert[e], up[e]]) for e in order])
            name = f"{prefix}.mlp.experts.gate_up_proj"
        else:
            stacked = torch.stack([by_expert[e] for e in order])
            name = f"{prefix}.mlp.experts.down_proj"
        fused[name if kind == "weight" else name + "_scale_inv"] = stacked
    (dst / "model.safetensors").unlink()
    save_file(fused, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
