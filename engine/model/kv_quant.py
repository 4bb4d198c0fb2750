"""fp8 KV cache: K and V stored as float8 e4m3, each layer's K and V with one float32 scale (vLLM's scheme).

    stored = clamp(x / scale, -448, 448).to(float8_e4m3fn)        (write, in write_kv)
    x     ~= stored.float() * scale                                (read, in either attention backend)

Scales are 1.0 unless the checkpoint carries calibrated ones (`k_scale`/`v_scale`, see loader.py).
e4m3 keeps 3 mantissa bits (a relative rounding error up to 2^-4) over magnitudes 2^-9 .. 448, so with
scale 1.0 K/V entries beyond +-448 are clipped and those below about 2^-9 flush towards zero.
Scales stay device tensors: nothing here reads them back to the host, so CUDA graphs can capture it.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def quantize_fp8(
    x: torch.Tensor,  # any shape, any float dtype
    scale: torch.Tensor,  # [] or [1] float32, on x's device
) -> torch.Tensor:  # x's shape, float8_e4m3fn
    """Divide by the scale in float32 and saturate at e4m3's range (a bare cast would give NaN past it)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    x: torch.Tensor,  # any shape, float8_e4m3fn
    scale: torch.Tensor,  # [] or [1] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # x's shape, `dtype`
    return (x.float() * scale).to(dtype)


def default_scale(device: torch.device) -> torch.Tensor:  # [1] float32
    return torch.ones(1, dtype=torch.float32, device=device)
