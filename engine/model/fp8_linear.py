"""FP8 base weights: float8 e4m3 projections with float32 scales, and the GEMMs that use them.

A weight is stored as `weight` [out, in] float8_e4m3fn and `scale` [out, num_groups] float32, the input
dimension cut into groups of `group_size` columns (the last one may be shorter):

    real[n, k] = weight[n, k] * scale[n, k // group_size]

One group per row (`group_size == in`) is the per-output-channel scheme: quantized on the fly
(scale = amax(row) / 448) or loaded from a compressed-tensors checkpoint. Groups of 128 hold the
block-wise checkpoints (Qwen/DeepSeek FP8: one scale per 128x128 block, repeated over the block's rows,
so fused q/k/v or gate/up stay exact whatever their sizes).

GEMMs (`Fp8Linear.gemm`):
- "dequant": `F.linear(x, dequantize(w))` in the compute dtype; the reference, and what the CPU runs.
- "scaled_mm": FP8 tensor cores through `torch._scaled_mm` (compute capability 8.9+; block groups 9.0).
  Activations are quantized per token on the fly (per token and 128 columns for block groups):
  x_scale = amax / 448 (one Triton kernel, fp8_quant_kernel.py), so both operands are e4m3 and the
  output comes back in bfloat16.
Neither reads a tensor back to the host, so decode steps that use them are captured in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.fp8_quant_kernel import quantize_activations_triton
from engine.model.kv_quant import FP8_DTYPE, FP8_MAX

BLOCK = 128  # the block-wise checkpoints' block edge, and the activation group of their GEMM
# Smallest scale: an all-zero row or token must not divide by zero (its values quantize to 0 anyway).
_MIN_AMAX = 1e-12


@dataclass
class Fp8Linear:
    """One (possibly fused) projection's FP8 weight; `linear` multiplies by it."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn, row-major (`.t()` is the column-major B of _scaled_mm)
    scale: torch.Tensor  # [out, num_groups] float32: real = weight * scale, per row and input group
    group_size: int  # input columns per scale: `in` (per channel) or BLOCK
    gemm: str = "dequant"  # "scaled_mm" or "dequant" (see the module docstring)
    # The scales laid out as _scaled_mm reads them, made once at load: [1, out] or [num_groups, out].
    gemm_scale: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        out_features, in_features = self.weight.shape
        if self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8Linear weight must be float8_e4m3fn, got {self.weight.dtype}")
        groups = -(-in_features // self.group_size)
        if self.scale.shape != (out_features, groups) or self.scale.dtype != torch.float32:
            raise ValueError(
                f"Fp8Linear scale must be float32 [{out_features}, {groups}] for a weight of "
                f"{tuple(self.weight.shape)} in groups of {self.group_size}, got {self.scale.dtype} "
                f"{tuple(self.scale.shape)}"
            )
        if self.gemm == "scaled_mm":
            # Rowwise: scale_b [1, out]; 1x128 blocks: scale_b [groups, out] whose .t() is outer-dim-major.
            self.gemm_scale = self.scale.t().contiguous()

    @property
    def shape(self) -> torch.Size:  # the logical [out, in], as the bf16 weight had
        return self.weight.shape

    @property
    def per_channel(self) -> bool:
        return self.scale.shape[1] == 1


def quantize_weight(
    w: torch.Tensor,  # [out, in], any float dtype
    group_size: int | None = None,  # None: one scale per output channel
) -> tuple[torch.Tensor, torch.Tensor]:  # weight [out, in] float8_e4m3fn, scale [out, num_groups] float32
    """scale = amax / 448 per row (and input group), weight = saturate(w / scale) rounded to e4m3."""
    scale = weight_scales(w, group_size)
    return quantize_with(w, scale, group_size), scale


def weight_scales(w: torch.Tensor, group_size: int | None = None) -> torch.Tensor:  # [out, num_groups]
    """amax / 448 of each row (and input group of `group_size` columns), in float32."""
    out_features, in_features = w.shape
    group_size = group_size or in_features
    groups = -(-in_features // group_size)
    w32 = F.pad(w.float(), (0, groups * group_size - in_features)).view(out_features, groups, group_size)
    return w32.abs().amax(dim=-1).clamp(min=_MIN_AMAX) / FP8_MAX


def quantize_with(
    w: torch.Tensor,  # [out, in], any float dtype
    scale: torch.Tensor,  # [out, num_groups] float32
    group_size: int | None = None,
) -> torch.Tensor:  # [out, in] float8_e4m3fn: saturate(w / scale) rounded to e4m3
    out_features, in_features = w.shape
    group_size = group_size or in_features
    groups = scale.shape[1]
    w32 = F.pad(w.float(), (0, groups * group_size - in_features)).view(out_features, groups, group_size)
    q = (w32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(out_features, -1)[:, :in_features].contiguous()


def expand_scale(
    scale: torch.Tensor,  # [out, num_groups]
    in_features: int,
    group_size: int,
) -> torch.Tensor:  # [out, in]: each column's scale
    return scale.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize(w: Fp8Linear, dtype: torch.dtype) -> torch.Tensor:  # [out, in] in `dtype`
    """The weight as real numbers: e4m3 values times their scales in float32, then rounded to `dtype`."""
    real = w.weight.float() * expand_scale(w.scale, w.weight.shape[1], w.group_size)
    return real.to(dtype)


BLOCK_GEMM_ROWS = 16  # block-scaled _scaled_mm runs on row counts padded to a multiple of this


def quantize_activations(
    x: torch.Tensor,  # [tokens, in], the compute dtype
    group_size: int,  # `in`: one scale per token; BLOCK: per token and 128 columns
) -> tuple[torch.Tensor, torch.Tensor]:  # [tokens, in] float8_e4m3fn, scales [tokens, num_groups] float32
    """Dynamic scales, amax / 448 of each token (group), computed on the device: no host sync."""
    tokens, in_features = x.shape
    groups = -(-in_features // group_size)
    x32 = x.float()
    if groups == 1:
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
        return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    x32 = F.pad(x32, (0, groups * group_size - in_features)).view(tokens, groups, group_size)
    scale = x32.abs().amax(dim=-1).clamp(min=_MIN_AMAX) / FP8_MAX
    q = (x32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(tokens, -1)[:, :in_features].contiguous(), scale


def linear(
    x: torch.Tensor,  # [tokens, in]
    w: torch.Tensor | Fp8Linear,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [tokens, out] in x's dtype
    """`F.linear` for plain weights; the FP8 GEMM the weight was loaded for otherwise."""
    if not isinstance(w, Fp8Linear):
        return F.linear(x, w, bias)
    if w.gemm == "dequant":
        return F.linear(x, dequantize(w, x.dtype), bias)
    return _scaled_mm_linear(x, w, bias)


def _scaled_mm_linear(x: torch.Tensor, w: Fp8Linear, bias: torch.Tensor | None) -> torch.Tensor:
    tokens = x.shape[0]
    if not w.per_channel and tokens % BLOCK_GEMM_ROWS:
        # cuBLAS refuses block-scaled GEMMs of some row counts (3 on an H100): pad to a multiple of 16.
        x = F.pad(x, (0, 0, 0, BLOCK_GEMM_ROWS - tokens % BLOCK_GEMM_ROWS))
    if x.is_cuda:  # one Triton kernel; scales already in the layout _scaled_mm reads
        x_fp8, x_scale = quantize_activations_triton(x, w.group_size)
    else:
        x_fp8, x_scale = quantize_activations(x, w.group_size)
        if not w.per_channel:
            # 1x128 blocks: _scaled_mm wants the activation scales outer-dim-major (stride (1, tokens)).
            x_scale = x_scale.t().contiguous().t()
    out = torch._scaled_mm(
        x_fp8, w.weight.t(), scale_a=x_scale, scale_b=w.gemm_scale, out_dtype=torch.bfloat16
    )
    out = out[:tokens].to(x.dtype)
    return out if bias is None else out + bias


def scaled_mm_problem(device: torch.device, w: Fp8Linear) -> str | None:
    """Why this GPU cannot run `w` through `_scaled_mm` (None: it can)."""
    if device.type != "cuda":
        return f"torch._scaled_mm needs a CUDA device, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"FP8 tensor cores need compute capability 8.9 or newer (this GPU is {capability[0]}.{capability[1]})"
    if not w.per_channel and capability[0] != 9:
        return "block-scaled FP8 GEMMs run on compute capability 9.x (Hopper) only"
    out_features, in_features = w.weight.shape
    if out_features % 16 or in_features % 16:
        return f"FP8 GEMM sizes must be multiples of 16 (this projection is {out_features} x {in_features})"
    return None
