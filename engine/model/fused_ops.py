"""The decoder's small element-wise ops as one Triton kernel each, for the Triton (CUDA) path.

In eager torch a layer's RMSNorm, residual add, RoPE and SiLU-and-mul are about forty tiny kernels; at a
decode step of batch 128 on shape S they took more GPU time than the GEMMs (docs/BENCHMARKS.md). Each
kernel here rounds where torch rounds (every intermediate the torch code keeps in the model dtype is
rounded to it), so the results are those of the torch ops in `layers/` and `rope.py` within one rounding
step where the order of the RMSNorm's sum, the exp of SiLU or a contracted multiply-add differ (rare).

Token counts vary per step: they are grid sizes, never kernel arguments, so nothing is specialised on
them (nothing compiles after start-up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def add_rounded(x, residual):
    """residual + x in float32, rounded to the residual's dtype (torch's residual add)."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)


@triton.jit
def rms_norm_row(
    x, weight_ptr, cols, mask, eps, HIDDEN: tl.constexpr, OFFSET: tl.constexpr, out_dtype: tl.constexpr
):
    """RMSNorm of one row `x` (in the model dtype, masked lanes 0) as transformers computes it: Llama's
    (normalised in float32, rounded, times weight) or Gemma's with OFFSET ((1 + weight), rounded once)."""
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / HIDDEN
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        out = (x32 * tl.math.rsqrt(variance + eps) * (1.0 + weight)).to(out_dtype)
    else:
        normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
        out = (weight * normed.to(tl.float32)).to(out_dtype)
    return out


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
    OFFSET: tl.constexpr,  # Gemma: scale by (1 + weight), all in float32, rounded once
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = add_rounded(x, r)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    out = rms_norm_row(x, weight_ptr, cols, mask, eps, HIDDEN, OFFSET, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * HIDDEN + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor,  # [tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [tokens, hidden]: becomes residual + x, and that is normed
    offset: bool = False,  # Gemma's RMSNorm: x * (1 + weight) in float32, in x's dtype
) -> torch.Tensor:  # [tokens, hidden]
    """transformers' LlamaRMSNorm (or GemmaRMSNorm with `offset`) of x, or of residual + x, stored back
    into residual: vLLM's fused add."""
    tokens, hidden = x.shape
    dtype = x.dtype if offset else torch.result_type(weight, x)
    out = torch.empty((tokens, hidden), dtype=dtype, device=x.device)
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
            OFFSET=offset,
        )
    return out


@triton.jit
def _tanh(x):
    """tanh in float32 through exp2 (Triton has no tanh of its own): exact to a few ulps."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2.885... = 2 * log2(e)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [tokens, 2 * width]: gate, then up; row stride stride_x
    out_ptr,  # [tokens, width], contiguous
    stride_x,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,  # False: SiLU (SwiGLU); True: GELU, tanh approximation (GeGLU)
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:  # F.gelu(approximate="tanh"), rounded to the model dtype
        act = (0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))).to(gate.dtype)
    else:  # F.silu, rounded to the model dtype
        act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * WIDTH + cols, out, mask=mask)


# Activations of a gated MLP, by the names checkpoints give them (hidden_act / hidden_activation).
ACTIVATIONS = {"silu": False, "swish": False, "gelu_pytorch_tanh": True, "gelu_tanh": True}


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up, gate and up the two halves of each row: [tokens, 2 * width] -> [tokens, width]."""
    tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _act_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), WIDTH=width, BLOCK=block, GELU_TANH=ACTIVATIONS[activation]
        )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * width] -> [tokens, width]
    """F.silu(gate) * up, gate and up the two halves of each row."""
    return act_and_mul(gate_up, "silu")


@triton.jit
def _rotate_heads(
    base,  # pointer to the token's first head of this group
    cos_first,
    cos_second,
    sin_first,
    sin_second,  # [1, BLOCK_HALF] float32 each
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2: the first rotary_dim dims of a head rotate, the rest pass
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first_ptr = base + heads * HEAD_DIM + dims
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(first_ptr + HALF, mask=mask, other=0.0)
    dtype = first.dtype
    x1, x2 = first.to(tl.float32), second.to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); each product and the sum rounded
    out1 = ((x1 * cos_first).to(dtype).to(tl.float32) + (-x2 * sin_first).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos_second).to(dtype).to(tl.float32) + (x1 * sin_second).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first_ptr, out1, mask=mask)
    tl.store(first_ptr + HALF, out2, mask=mask)


@triton.jit
def _rope_kernel(
    qkv_ptr,  # [tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM], row stride stride_t; q and k in place
    cos_ptr,  # [max_positions, 2 * HALF], contiguous
    sin_ptr,
    positions_ptr,  # [tokens]
    stride_t,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < HALF
    row = position * (2 * HALF)
    cos_first = tl.load(cos_ptr + row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    base = qkv_ptr + token * stride_t
    _rotate_heads(
        base, cos_first, cos_second, sin_first, sin_second, NUM_HEADS, HEAD_DIM, HALF, BLOCK_HEADS, BLOCK_HALF
    )
    k_base = base + NUM_HEADS * HEAD_DIM
    _rotate_heads(
        k_base,
        cos_first,
        cos_second,
        sin_first,
        sin_second,
        NUM_KV_HEADS,
        HEAD_DIM,
        HALF,
        BLOCK_KV_HEADS,
        BLOCK_HALF,
    )


def supports_fused_rope(rotary_dim: int) -> bool:
    """The kernel rotates pairs (i, i + rotary_dim / 2): any even rotary width."""
    return rotary_dim % 2 == 0 and rotary_dim >= 2


def apply_rope_(
    qkv: torch.Tensor,  # [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q and k rotated in place
    positions: torch.Tensor,  # [tokens]
    cos: torch.Tensor,  # [max_positions, rotary_dim]
    sin: torch.Tensor,  # [max_positions, rotary_dim]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """RoPE on the q and k parts of a fused qkv projection, as `RotaryEmbedding.__call__` computes it
    (the first rotary_dim dims of each head rotate: all of them unless partial_rotary_factor < 1)."""
    tokens = qkv.shape[0]
    if not tokens:
        return
    if qkv.stride(1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("apply_rope_ needs rows of qkv and the cos/sin tables contiguous")
    half = cos.shape[1] // 2
    _rope_kernel[(tokens,)](
        qkv,
        cos,
        sin,
        positions,
        qkv.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )


@triton.jit
def _norm_rotate_heads(
    base,  # pointer to the token's first head of this group
    weight_ptr,  # [HEAD_DIM]: this group's norm weight
    cos1,
    cos2,
    sin1,
    sin2,  # [1, BLOCK_HALF] float32 each
    eps,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    OFFSET: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < half)
    ptr = base + heads * HEAD_DIM + dims
    first = tl.load(ptr, mask=mask, other=0.0)
    second = tl.load(ptr + half, mask=mask, other=0.0)
    dtype = first.dtype
    f1, f2 = first.to(tl.float32), second.to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
    if OFFSET:  # Gemma: x * (1 + w) in float32, rounded once
        x1 = (f1 * inv * (1.0 + w1)).to(dtype).to(tl.float32)
        x2 = (f2 * inv * (1.0 + w2)).to(dtype).to(tl.float32)
    else:  # Llama: normalised, rounded, then times w, rounded
        x1 = (w1 * (f1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (f2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(ptr, out1, mask=mask)
    tl.store(ptr + half, out2, mask=mask)


@triton.jit
def _head_norm_rope_kernel(
    qkv_ptr,  # [tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM], row stride stride_t; q and k in place
    cos_ptr,  # [max_positions, HEAD_DIM], contiguous
    sin_ptr,
    positions_ptr,  # [tokens]
    weight_ptr,  # [2, HEAD_DIM]: q_norm's weight, then k_norm's
    stride_t,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    OFFSET: tl.constexpr,
):
    """One token per program: RMSNorm over each q and k head (Qwen3's and Gemma 3's q/k norm), then RoPE."""
    token = tl.program_id(0)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    row = tl.load(positions_ptr + token) * HEAD_DIM
    cos1 = tl.load(cos_ptr + row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + half + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + half + dims, mask=dim_mask, other=0.0).to(tl.float32)
    base = qkv_ptr + token * stride_t
    _norm_rotate_heads(
        base, weight_ptr, cos1, cos2, sin1, sin2, eps, NUM_HEADS, HEAD_DIM, BLOCK_HEADS, BLOCK_HALF, OFFSET
    )
    _norm_rotate_heads(
        base + NUM_HEADS * HEAD_DIM,
        weight_ptr + HEAD_DIM,
        cos1,
        cos2,
        sin1,
        sin2,
        eps,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK_KV_HEADS,
        BLOCK_HALF,
        OFFSET,
    )


def head_norm_rope_(
    qkv: torch.Tensor,  # [tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q and k in place
    positions: torch.Tensor,  # [tokens]
    cos: torch.Tensor,  # [max_positions, head_dim]: full rotary width only
    sin: torch.Tensor,
    qk_weight: torch.Tensor,  # [2, head_dim] contiguous: q_norm's weight, then k_norm's
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    offset: bool,
) -> None:
    """Per-head RMSNorm of q and k (q_norm, k_norm), then RoPE, in one kernel (a program per token, all its
    heads at once); v is left alone."""
    tokens = qkv.shape[0]
    if not tokens:
        return
    if qkv.stride(1) != 1 or cos.shape[1] != head_dim or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("head_norm_rope_ needs contiguous rows and a full-width rotary table")
    _head_norm_rope_kernel[(tokens,)](
        qkv,
        cos,
        sin,
        positions,
        qk_weight,
        qkv.stride(0),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        OFFSET=offset,
    )
