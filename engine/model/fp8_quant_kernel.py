"""Dynamic activation quantization for the FP8 GEMM in one Triton kernel, instead of five torch ones.

Per token (and 128-column group for block-scaled weights): scale = max(amax, 1e-12) / 448, stored =
saturate(x / scale) as e4m3, exactly `fp8_linear.quantize_activations` (the torch reference the tests
compare with). A decode step runs it before every FP8 projection, so launches count: one program per
(token, group) row reads its slice twice (amax, then quantize) and writes the scale where
`torch._scaled_mm` reads it: [tokens, 1] for per-token scales, and for 128-column groups the
outer-dim-major [tokens, groups] layout (stride (1, tokens)) its block-scaled path wants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.kv_quant import FP8_DTYPE, FP8_MAX

_MIN_AMAX = 1e-12


# scale_stride_g is the step's token count (block-scaled weights): specialising on it (== 1, divisible
# by 16) would compile new variants mid-serving.
@triton.jit(do_not_specialize=["scale_stride_g"])
def _quantize_rows_kernel(
    x_ptr,  # [tokens, in], the compute dtype, row stride `stride_x`
    out_ptr,  # [tokens, in] float8_e4m3fn, contiguous
    scale_ptr,  # per (token, group): at token * scale_stride_t + group * scale_stride_g, float32
    stride_x,
    scale_stride_t,
    scale_stride_g,
    IN_FEATURES: tl.constexpr,  # constexpr: a model has a handful of sizes, and the loops unroll
    GROUP_SIZE: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    group = tl.program_id(1)
    start = group * GROUP_SIZE
    end = tl.minimum(start + GROUP_SIZE, IN_FEATURES)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, GROUP_SIZE, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + token * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX_VALUE
    tl.store(scale_ptr + token * scale_stride_t + group * scale_stride_g, scale)
    for offset in range(0, GROUP_SIZE, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = cols < end
        x = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        # div_rn: IEEE division, as torch divides (plain `/` may be 2 ulp off)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_VALUE, FP8_MAX_VALUE)
        tl.store(out_ptr + token * IN_FEATURES + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_activations_triton(
    x: torch.Tensor,  # [tokens, in], rows contiguous
    group_size: int,  # `in`: one scale per token; 128: per token and 128 columns
) -> tuple[torch.Tensor, torch.Tensor]:  # [tokens, in] e4m3; scales [tokens, groups] float32 (see above)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}"
        )
    tokens, in_features = x.shape
    groups = -(-in_features // group_size)
    out = torch.empty((tokens, in_features), dtype=FP8_DTYPE, device=x.device)
    if groups == 1:
        scale = torch.empty((tokens, 1), dtype=torch.float32, device=x.device)
        strides = (1, 0)
    else:  # outer-dim-major: a [groups, tokens] buffer seen as [tokens, groups]
        scale = torch.empty((groups, tokens), dtype=torch.float32, device=x.device).t()
        strides = (1, tokens)
    if tokens == 0:
        return out, scale
    block = min(1024, triton.next_power_of_2(min(group_size, in_features)))
    _quantize_rows_kernel[(tokens, groups)](
        x,
        out,
        scale,
        x.stride(0),
        *strides,
        IN_FEATURES=in_features,
        GROUP_SIZE=min(group_size, in_features),
        FP8_MAX_VALUE=FP8_MAX,
        MIN_AMAX=_MIN_AMAX,
        BLOCK=block,
    )
    return out, scale
