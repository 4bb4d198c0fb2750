"""The decoder's small element-wise ops as one Triton kernel each, for the Triton (CUDA) path.

In eager torch a layer's RMSNorm, residual add, RoPE and SiLU-and-mul are about forty tiny kernels; at a
decode step of batch 128 on shape S they took more GPU time than the GEMMs (docs/BENCHMARKS.md). Each
kernel here rounds where torch rounds (every intermediate the torch code keeps in the model dtype is
rounded to it), so the results are those of the torch ops in `llama.py` and `rope.py` within one rounding
step where the order of the RMSNorm's sum, the exp of SiLU or a contracted multiply-add differ (rare).

Token counts vary per step: they are grid sizes, never kernel arguments, so nothing is specialised on
them (nothing compiles after start-up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [tokens, hidden], row stride stride_x
    residual_ptr,  # [tokens, hidden], row stride stride_r; updated in place to residual + x (if HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [tokens, hidden], contiguous
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # the residual add, rounded as torch's
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / HIDDEN
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * HIDDEN + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [tokens, hidden]: becomes residual + x, and that is normed
) -> torch.Tensor:  # [tokens, hidden]
    """transformers' LlamaRMSNorm of x (or of residual + x, stored back into residual: vLLM's fused add)."""
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=torch.result_type(weight, x), device=x.device)
    if tokens:
        target = residual if residual is not None else x
        _rms_norm_kernel[(tokens,)](
            x,
            target,
            weight,
            out,
            x.stride(0),
            target.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [tokens, 2 * width]: gate, then up; row stride stride_x
    out_ptr,  # [tokens, width], contiguous
    stride_x,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)  # F.silu, rounded to the model dtype
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * WIDTH + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * width] -> [tokens, width]
    """F.silu(gate) * up, gate and up the two halves of each row."""
    tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), WIDTH=width, BLOCK=block
        )
    return out


@triton.jit
def _rotate_heads(
    base,  # pointer to the token's first head of this group
    cos_first,
    cos_second,
    sin_first,
    sin_second,  # [HALF] float32 each
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, half)[None, :]
    mask = heads < NUM_HEADS
    first_ptr = base + heads * HEAD_DIM + dims
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(first_ptr + half, mask=mask, other=0.0)
    dtype = first.dtype
    x1, x2 = first.to(tl.float32), second.to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); each product and the sum rounded
    out1 = ((x1 * cos_first).to(dtype).to(tl.float32) + (-x2 * sin_first).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos_second).to(dtype).to(tl.float32) + (x1 * sin_second).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first_ptr, out1, mask=mask)
    tl.store(first_ptr + half, out2, mask=mask)


@triton.jit
def _rope_kernel(
    qkv_ptr,  # [tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM], row stride stride_t; q and k in place
    cos_ptr,  # [max_positions, HEAD_DIM], contiguous
    sin_ptr,
    positions_ptr,  # [tokens]
    stride_t,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, half)[None, :]
    row = position * HEAD_DIM
    cos_first = tl.load(cos_ptr + row + dims).to(tl.float32)
    cos_second = tl.load(cos_ptr + row + half + dims).to(tl.float32)
    sin_first = tl.load(sin_ptr + row + dims).to(tl.float32)
    sin_second = tl.load(sin_ptr + row + half + dims).to(tl.float32)
    base = qkv_ptr + token * stride_t
    _rotate_heads(base, cos_first, cos_second, sin_first, sin_second, NUM_HEADS, HEAD_DIM, BLOCK_HEADS)
    k_base = base + NUM_HEADS * HEAD_DIM
    _rotate_heads(
        k_base, cos_first, cos_second, sin_first, sin_second, NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_HEADS
    )


def supports_fused_rope(head_dim: int) -> bool:
    """The kernel loads half a head as one power-of-two block."""
    return head_dim % 2 == 0 and triton.next_power_of_2(head_dim // 2) == head_dim // 2


def apply_rope_(
    qkv: torch.Tensor,  # [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q and k rotated in place
    positions: torch.Tensor,  # [tokens]
    cos: torch.Tensor,  # [max_positions, head_dim]
    sin: torch.Tensor,  # [max_positions, head_dim]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """RoPE on the q and k parts of a fused qkv projection, as `RotaryEmbedding.__call__` computes it."""
    tokens = qkv.shape[0]
    if not tokens:
        return
    if qkv.stride(1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("apply_rope_ needs rows of qkv and the cos/sin tables contiguous")
    _rope_kernel[(tokens,)](
        qkv,
        cos,
        sin,
        positions,
        qkv.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
    )
