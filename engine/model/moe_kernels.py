"""The fused mixture-of-experts computation: out[t] = sum_k w[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)),
e = ids[t, k], for every token's top-k experts, as two grouped GEMMs over the experts (Triton), or in torch.

Tokens are sorted by expert first (`align_by_expert`): each (token, k) pair gets a row of a padded list in
which every expert's pairs fill whole blocks of `block_m` rows, so one program of the grouped GEMM reads
one expert's weights for up to `block_m` tokens. The sizes are fixed by the number of pairs (no host sync,
so decode steps capture in CUDA graphs): `num_pairs + num_experts * (block_m - 1)` rows at most.

    kernel 1 (gate/up fused): inter[p] = act(x[p // K] @ W13[e, :I]^T + b13[e, :I], x[p // K] @ W13[e, I:]^T
                                             + b13[e, I:])
    kernel 2 (down):          out[p]   = w[p] * (inter[p] @ W2[e]^T + b2[e])
(the biases where the experts have them: gpt-oss)
    then                      y[t]     = sum_k out[t * K + k]

Pairs routed to an expert this rank does not hold (expert parallelism) carry id `num_experts` and are
skipped: their rows stay zero, and the all-reduce after the layer adds the rank that holds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lora_kernels.tiles import interpreting

# "silu": SiLU(gate) * up. "clamped_swiglu" (gpt-oss): gate <= limit, -limit <= up <= limit, then
# (up + 1) * gate * sigmoid(alpha * gate).
MOE_ACTIVATIONS = ("silu", "clamped_swiglu")


def align_by_expert(
    ids: torch.Tensor,  # [num_pairs] int, in [0, num_experts]; num_experts = not on this rank
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_rows] int32, block_expert [max_rows // block_m] int32).

    sorted_pairs lists each expert's pair ids, each expert's run padded to a multiple of block_m with
    `num_pairs` (a row no pair owns); block_expert is each block's expert, -1 past the last block."""
    num_pairs = ids.numel()
    max_rows = num_pairs + num_experts * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    device = ids.device
    ids = ids.long()
    counts = expert_counts(ids, num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E]
    starts = ends - padded
    order = torch.argsort(ids, stable=True)  # pairs by expert, then by pair id
    sorted_ids = ids[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E] first index in `order`
    local = sorted_ids.clamp(max=num_experts - 1)
    position = torch.arange(num_pairs, device=device) - first_of_expert[local] + starts[local]
    rows = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    keep = sorted_ids < num_experts  # pairs of other ranks' experts go to the spare last row
    rows[torch.where(keep, position, max_rows)] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows[:max_rows], block_expert


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts] int64 pairs per expert (ids of -1 not counted); unlike bincount, its size never
    depends on the data (no sync, so it captures in a CUDA graph)."""
    ids = ids.reshape(-1).long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, torch.where(ids < 0, num_experts, ids), torch.ones_like(ids))
    return counts[:num_experts]


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [num_tokens, hidden]
    w_ptr,  # [E, 2 * inter, hidden]
    out_ptr,  # [num_pairs, inter]
    delta_ptr,  # [num_pairs, 2 * inter] LoRA's gate/up update (HAS_DELTA)
    bias_ptr,  # [E, 2 * inter] (HAS_BIAS)
    rows_ptr,  # [max_rows] int32 pair ids sorted by expert
    block_expert_ptr,  # [num_blocks] int32
    num_pairs,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    stride_dt,
    stride_be,
    limit,  # CLAMPED: the clamp of gate (above) and up (both sides)
    alpha,  # CLAMPED: the sigmoid's gain
    TOP_K: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,  # the clamped SwiGLU (gpt-oss), else SiLU(gate) * up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // TOP_K, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_ITERS):
        offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(
            x_ptr + tokens[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + inter) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            acc_gate = tl.dot(a, wg.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, wu.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, wg, acc_gate)
            acc_up = tl.dot(a, wu, acc_up)
    safe = tl.where(valid, pairs, 0).to(tl.int64)
    mask = valid[:, None] & n_ok[None, :]
    if HAS_DELTA:
        delta = delta_ptr + safe[:, None] * stride_dt + offs_n[None, :]
        acc_gate += tl.load(delta, mask=mask, other=0.0).to(tl.float32)
        acc_up += tl.load(delta + inter, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * stride_be + offs_n
        acc_gate += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    else:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) * up
    out = out_ptr + safe[:, None] * stride_ot + offs_n[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(
    a_ptr,  # [num_pairs, inter]
    w_ptr,  # [E, hidden, inter]
    weights_ptr,  # [num_pairs] float32 routing weights
    out_ptr,  # [num_pairs, hidden]
    delta_ptr,  # [num_pairs, hidden] LoRA's down update (HAS_DELTA)
    bias_ptr,  # [E, hidden] (HAS_BIAS)
    rows_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    stride_dt,
    stride_be,
    HAS_DELTA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs < num_pairs
    safe = tl.where(valid, pairs, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(K_ITERS):
        offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(
            a_ptr + safe[:, None] * stride_at + offs_k[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    mask = valid[:, None] & n_ok[None, :]
    if HAS_DELTA:
        acc += tl.load(delta_ptr + safe[:, None] * stride_dt + offs_n[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    if HAS_BIAS:
        bias = bias_ptr + expert.to(tl.int64) * stride_be + offs_n
        acc += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    route = tl.load(weights_ptr + safe, mask=valid, other=0.0)
    acc = acc * route[:, None]
    out = out_ptr + safe[:, None] * stride_ot + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per program: small at decode (few pairs per expert), larger for prefill."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


_BLOCK_N, _BLOCK_K = 64, 64


def gate_up_act(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]
    rows: torch.Tensor,  # align_by_expert's
    block_expert: torch.Tensor,
    top_k: int,
    delta: torch.Tensor | None = None,  # [T * K, 2 * I], added before the activation (LoRA)
    bias: torch.Tensor | None = None,  # [E, 2 * I]
    limit: float | None = None,  # given: the clamped SwiGLU (MOE_ACTIVATIONS), else SiLU
    alpha: float = 1.0,
) -> torch.Tensor:  # [T * K, I]: act(gate, up) per pair (rows of skipped pairs undefined)
    num_tokens, hidden = x.shape
    inter_size = w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    block_m = rows.numel() // block_expert.numel()
    x, w13 = x.contiguous(), w13.contiguous()
    out = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(inter_size, _BLOCK_N))
    _gate_up_kernel[grid](
        x, w13, out, out if delta is None else delta, out if bias is None else bias, rows, block_expert,
        num_pairs, hidden, inter_size, x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        0 if delta is None else delta.stride(0), 0 if bias is None else bias.stride(0),
        0.0 if limit is None else float(limit), float(alpha),
        TOP_K=top_k, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, CLAMPED=limit is not None,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        K_ITERS=triton.cdiv(hidden, _BLOCK_K), DOT_FP32=x.dtype == torch.float32 or interpreting(),
    )  # fmt: skip
    return out


def down_weighted(
    inter: torch.Tensor,  # [T * K, I]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T * K] routing weights
    rows: torch.Tensor,
    block_expert: torch.Tensor,
    delta: torch.Tensor | None = None,  # [T * K, H], added before the routing weight (LoRA)
    bias: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:  # [T * K, H]: weight * (inter @ W2[e]^T + bias[e] + delta); zero for skipped pairs
    num_pairs, inter_size = inter.shape
    hidden = w2.shape[1]
    block_m = rows.numel() // block_expert.numel()
    w2 = w2.contiguous()
    out = torch.zeros(num_pairs, hidden, dtype=inter.dtype, device=inter.device)
    grid = (block_expert.numel(), triton.cdiv(hidden, _BLOCK_N))
    _down_kernel[grid](
        inter, w2, weights.float().contiguous(), out, out if delta is None else delta,
        out if bias is None else bias, rows, block_expert, num_pairs, hidden, inter_size, inter.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), 0 if delta is None else delta.stride(0),
        0 if bias is None else bias.stride(0),
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        K_ITERS=triton.cdiv(inter_size, _BLOCK_K), DOT_FP32=inter.dtype == torch.float32 or interpreting(),
    )  # fmt: skip
    return out


# -- the torch path (CPU, and where Triton cannot run): the same two steps, one GEMM per expert ---------


def gate_up_act_torch(x, w13, ids, top_k, delta=None, bias=None, limit=None, alpha=1.0):  # ids [T * K]
    num_experts, two_i, _ = w13.shape
    pre = torch.zeros(ids.numel(), two_i, dtype=x.dtype, device=x.device)
    tokens = torch.arange(ids.numel(), device=x.device) // top_k
    for expert in torch.unique(ids).tolist():
        if expert < num_experts:
            pairs = (ids == expert).nonzero().squeeze(1)
            pre[pairs] = F.linear(x[tokens[pairs]], w13[expert], None if bias is None else bias[expert])
    if delta is not None:
        pre += delta
    gate, up = pre.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def down_weighted_torch(inter, w2, weights, ids, delta=None, bias=None):  # as down_weighted
    num_experts = w2.shape[0]
    out = torch.zeros(inter.shape[0], w2.shape[1], dtype=inter.dtype, device=inter.device)
    for expert in torch.unique(ids).tolist():
        if expert < num_experts:
            pairs = (ids == expert).nonzero().squeeze(1)
            out[pairs] = F.linear(inter[pairs], w2[expert], None if bias is None else bias[expert])
    if delta is not None:
        out += delta
    out *= weights.to(out.dtype)[:, None]
    return out.masked_fill_((ids >= num_experts)[:, None], 0.0)
