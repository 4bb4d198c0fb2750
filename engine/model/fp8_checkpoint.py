"""Which FP8 scheme a model loads with, from `quantization` and config.json's `quantization_config`, and
how a projection's checkpoint scales become an `Fp8Linear`'s (engine/model/layers/linear.py loads them).

Accepted checkpoints (anything else is refused, naming the format):
- compressed-tensors (llm-compressor): `quant_method: "compressed-tensors"`, format `float-quantized`
  (or `naive-quantized`), weights `num_bits: 8, type: float`, strategy `channel` (`weight_scale`
  [out, 1]), `tensor` (one number) or `block` 128x128; activations absent (weight-only) or 8-bit float.
- block-wise FP8 (Qwen, DeepSeek): `quant_method: "fp8"`, `weight_block_size: [128, 128]`,
  `activation_scheme: dynamic`, `weight_scale_inv` [ceil(out/128), ceil(in/128)] (multiplied, despite the
  name); without `weight_block_size`, vLLM's per-tensor `weight_scale`.
Scales are "real = stored * scale" in every format. Static activation scales (`input_scale`) are dropped:
activations are always quantized per token at run time, which is at least as fine as one scale per tensor.
A projection a checkpoint left unquantized (its `ignore` list) is quantized on load like the rest.

Under tensor parallelism every rank loads its shard: scales are one per row (and 128-column group), so
they split with their rows; a row-parallel projection cut over ranks keeps whole 128-column groups (a
block-scaled checkpoint whose shard boundary cuts a block is refused, engine/parallel/plan.py), and
quantized on the fly its per-row scales are the maximum over the ranks' columns, as on one GPU.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.engine_args import FP8_GEMMS, QUANTIZATIONS
from engine.model.fp8_linear import BLOCK, Fp8Linear, scaled_mm_problem

ON_THE_FLY = "fp8 (on the fly)"
COMPRESSED_TENSORS = "compressed-tensors"
BLOCK_FP8 = "fp8 (checkpoint)"
# Tensors beside a projection's `.weight`: its scale under either name, and static input scales (dropped).
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
DROPPED_NAMES = ("input_scale",)
_CT_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("channel", "tensor", "block")


def fp8_scheme(hf_config, quantization: str | None, dequantized: tuple[str, ...] = ()) -> str | None:
    """The scheme the weights load with (None: unquantized); ValueError naming an unsupported format.
    `dequantized`: the quant methods the architecture dequantizes at load (gpt-oss's "mxfp4")."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or 'fp8' (got {quantization!r})")
    config = _quantization_config(hf_config)
    if config is None:
        return ON_THE_FLY if quantization == "fp8" else None
    method = config.get("quant_method")
    if method in dequantized:
        if quantization is not None:
            raise ValueError(
                f"the checkpoint is quantized with {method!r}, which is dequantized to the model dtype at "
                f"load; quantization={quantization!r} on top of it is not served"
            )
        return None
    if method == "compressed-tensors":
        _check_compressed_tensors(config)
        return COMPRESSED_TENSORS
    if method == "fp8":
        _check_fp8(config)
        return BLOCK_FP8
    raise ValueError(
        f"the checkpoint is quantized with {method!r} (config.json quantization_config), which this engine "
        "does not serve; supported: FP8 checkpoints (compressed-tensors float8, or quant_method 'fp8' with "
        "128x128 blocks), or a bf16/fp16/fp32 checkpoint with quantization='fp8'"
    )


def _quantization_config(hf_config) -> dict | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None or isinstance(config, dict):
        return config
    return config.to_dict()


def _check_compressed_tensors(config: Mapping) -> None:
    def refuse(what: str) -> None:
        raise ValueError(
            f"compressed-tensors checkpoint with {what} is not supported; supported: float8 weights "
            "(num_bits 8, type float, strategy channel, tensor or 128x128 block), activations absent or float8"
        )

    if config.get("sparsity_config"):
        refuse("a sparsity_config")
    groups = config.get("config_groups") or {}
    if not groups:
        refuse("no config_groups")
    for name, group in groups.items():
        fmt = group.get("format") or config.get("format")
        if fmt not in _CT_FORMATS:
            refuse(f"format {fmt!r} (group {name})")
        weights = group.get("weights") or {}
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if bits != 8 or kind != "float":
            refuse(f"{bits}-bit {kind} weights (group {name})")
        if strategy not in _CT_STRATEGIES or not weights.get("symmetric", True):
            refuse(f"weight strategy {strategy!r} (group {name})")
        if strategy == "block" and list(weights.get("block_structure") or []) != [BLOCK, BLOCK]:
            refuse(f"weight blocks {weights.get('block_structure')} (group {name})")
        acts = group.get("input_activations")
        if acts is not None and (acts.get("num_bits") != 8 or acts.get("type") != "float"):
            refuse(f"{acts.get('num_bits')}-bit {acts.get('type')} activations (group {name})")
        if group.get("output_activations"):
            refuse(f"output activation quantization (group {name})")


def _check_fp8(config: Mapping) -> None:
    fmt = config.get("fmt", "e4m3")
    block = config.get("weight_block_size")
    scheme = config.get("activation_scheme", "dynamic")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint in format {fmt!r} is not supported; only e4m3")
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"fp8 checkpoint with weight_block_size {block} is not supported; only [128, 128]")
    if block is not None and scheme != "dynamic":
        raise ValueError(f"block-wise fp8 checkpoint with activation_scheme {scheme!r} is not supported")


def is_block_scaled(hf_config) -> bool:
    """Whether the checkpoint's scales come in 128x128 blocks (then an FP8 projection keeps one scale per
    row and 128 input columns, and quantizes what it quantizes itself the same way)."""
    config = _quantization_config(hf_config) or {}
    if config.get("quant_method") == "fp8":
        return config.get("weight_block_size") is not None
    groups = (config.get("config_groups") or {}).values()
    return any((group.get("weights") or {}).get("strategy") == "block" for group in groups)


def check_scales(name: str, scale: torch.Tensor) -> None:
    """A checkpoint's weight scales (float32) are positive and finite; ValueError naming the tensor."""
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ValueError(f"{name}: weight scales must be positive and finite")


def grouped_scale(
    name: str,  # the scale's checkpoint name, for errors
    weight_shape: tuple[int, int],  # [out, in] of the weight the scale belongs to
    scale: torch.Tensor,  # per tensor (one number), per channel ([out] or [out, 1]) or per 128x128 block
    group_size: int,
) -> torch.Tensor:  # [out, ceil(in / group_size)] float32
    """A checkpoint's weight scale as one scale per row and input group (each block's scale on each of its
    rows), so the rows of fused or sharded projections keep their own scales exactly."""
    out_features, in_features = weight_shape
    groups = -(-in_features // group_size)
    scale = scale.float()
    blocks = (-(-out_features // BLOCK), -(-in_features // BLOCK))
    if scale.numel() == 1:  # per tensor
        scale = scale.reshape(1, 1).expand(out_features, 1)
    elif tuple(scale.shape) in ((out_features,), (out_features, 1)):  # per channel
        scale = scale.reshape(out_features, 1)
    elif tuple(scale.shape) == blocks and group_size == min(BLOCK, in_features):
        scale = scale.repeat_interleave(BLOCK, dim=0)[:out_features]
    else:
        raise ValueError(
            f"{name}: weight scale of shape {tuple(scale.shape)} fits no supported scheme for a weight of "
            f"{list(weight_shape)} (per tensor: 1, per channel: [{out_features}, 1], blocks: {list(blocks)})"
        )
    check_scales(name, scale)
    return scale.expand(out_features, groups).contiguous() if scale.shape[1] == 1 else scale.contiguous()


def resolve_gemm(name: str, linear: Fp8Linear, device: torch.device, gemm: str) -> str:
    """The GEMM `linear` runs with: `gemm`, or for "auto" scaled_mm where the GPU can and dequant else."""
    if gemm not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)} (got {gemm!r})")
    if gemm == "dequant":
        return gemm
    problem = scaled_mm_problem(device, linear)
    if not linear.per_channel and problem is None and linear.weight.shape[1] % BLOCK:
        problem = f"block-scaled FP8 GEMMs need in_features divisible by {BLOCK}"
    if problem is None:
        return "scaled_mm"
    if gemm == "scaled_mm":
        raise ValueError(
            f"fp8_gemm 'scaled_mm' cannot run {name}: {problem}; use fp8_gemm 'dequant' or 'auto'"
        )
    return "dequant"
