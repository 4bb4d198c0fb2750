"""LoRA on the routed experts of a mixture of experts, read straight from the paged pool: for every
(token, expert) pair p of a step, with slot s = the token's adapter slot and e = its local expert,

    h_p     = scale_s * A[s, e] x_p     [R]    (ranks past the adapter's rank zeroed)
    delta_p = B[s, e] h_p               [out]  (fp32 throughout, one rounding to delta's dtype)

One program per pair does both halves: it walks the slot's page-table row (rank r lives in page
page_table[s, r // PAGE_RANK], row r % PAGE_RANK of that page's expert-e block), so nothing is gathered
into a per-pair copy of A or B, and h never leaves registers. Pairs of base-model tokens (slot -1) and of
experts another rank holds (id >= num_local) read nothing and write zeros.

Why per pair, not per (slot, expert) tile: at decode the pairs rarely share one. Batch 128 over 16
adapters with top-8 of 128 experts is 1024 pairs over 2048 possible (adapter, expert) pairs, so a
program reads each pair's own A and B once, which is what the step must read anyway; the weights it
shares with a neighbour come from L2. At prefill sizes many pairs share one (a prompt's tokens are
of one adapter), so there the caller passes `pair_order` (pairs grouped by (slot, expert)): programs
that run together then read the same A and B, from HBM about once. The grid is (num_pairs,) whatever the
slots and experts hold (no host sync: CUDA-graph safe).

Tiles: the rank block is the pool's page-table width in ranks (masked at the slot's rank, so a rank-8
adapter in a rank-64 pool loads 8 rows), the K and N blocks hold about TILE_ELEMENTS weights per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # weights one program loads per step of K (A) or N (B): 8 KB of bf16


@triton.jit
def _expert_lora_kernel(
    out_ptr,  # [num_pairs, out]
    x_ptr,  # [rows, in]: row p // X_ROW_DIV is pair p's input
    a_ptr,  # pool A [num_pages, E, PAGE_RANK, in] (strided)
    b_ptr,  # pool B [num_pages, E, out, PAGE_RANK] (strided)
    page_table_ptr,  # [max_loras, max_pages] int32
    token_slots_ptr,  # [num_tokens] int: slot of token p // TOP_K, < 0 for the base model
    ids_ptr,  # [num_pairs] int: local expert, >= num_local for another rank's
    order_ptr,  # [num_pairs] int: program i computes pair order[i] (HAS_ORDER), else pair i
    scales_ptr,  # [max_loras] float32
    ranks_ptr,  # [max_loras] int32
    in_features,
    out_features,
    num_local,
    stride_out,
    stride_x,
    stride_a_page,
    stride_a_expert,
    stride_a_rank,
    stride_b_page,
    stride_b_expert,
    stride_b_out,
    stride_page_table,
    TOP_K: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    X_ROW_DIV: tl.constexpr,
    PAGE_RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ITERS: tl.constexpr,
    N_ITERS: tl.constexpr,
):
    pair = tl.program_id(0)
    if HAS_ORDER:
        pair = tl.load(order_ptr + pair).to(tl.int32)
    slot = tl.load(token_slots_ptr + pair // TOP_K).to(tl.int32)
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    active = (slot >= 0) & (expert < num_local)
    slot = tl.where(active, slot, 0)
    expert = tl.where(active, expert, 0).to(tl.int64)
    rank = tl.where(active, tl.load(ranks_ptr + slot), 0)
    scale = tl.load(scales_ptr + slot)

    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    # Ranks past the slot's pages hold stale ids: masked by r_ok, never used as addresses.
    pages = tl.load(page_table_ptr + slot * stride_page_table + offs_r // PAGE_RANK, mask=r_ok, other=0)
    pages = pages.to(tl.int64)
    a_rows = a_ptr + pages * stride_a_page + expert * stride_a_expert + (offs_r % PAGE_RANK) * stride_a_rank
    x_row = x_ptr + (pair // X_ROW_DIV).to(tl.int64) * stride_x
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for i in range(K_ITERS):
        offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < in_features
        # Inactive pairs' inputs may be garbage (rows the fused-MoE kernel skipped): never loaded.
        x = tl.load(x_row + offs_k, mask=k_ok & active, other=0.0).to(tl.float32)
        a = tl.load(a_rows[:, None] + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        h += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    h = h * scale

    b_cols = b_ptr + pages * stride_b_page + expert * stride_b_expert + offs_r % PAGE_RANK  # [BLOCK_R]
    out_row = out_ptr + pair.to(tl.int64) * stride_out
    for j in range(N_ITERS):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < out_features
        b = tl.load(
            b_cols[None, :] + offs_n[:, None] * stride_b_out, mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )
        delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
        tl.store(out_row + offs_n, delta.to(out_ptr.dtype.element_ty), mask=n_ok)


def expert_lora_delta(
    x: torch.Tensor,  # [num_tokens, in] (per_pair_input False) or [num_pairs, in] (True)
    lora_a: torch.Tensor,  # [num_pages, E, PAGE_RANK, in]: one layer's pool view
    lora_b: torch.Tensor,  # [num_pages, E, out, PAGE_RANK]
    page_table: torch.Tensor,  # [max_loras, max_pages] int32
    token_slots: torch.Tensor,  # [num_tokens] int, < 0 for base-model tokens
    local_ids: torch.Tensor,  # [num_tokens * top_k] int, >= num_local for another rank's experts
    scales: torch.Tensor,  # [max_loras] float32
    ranks: torch.Tensor,  # [max_loras] int32
    top_k: int,
    num_local: int,
    per_pair_input: bool,
    order: torch.Tensor | None = None,  # [num_pairs] int: the pairs in the order programs take them
) -> torch.Tensor:  # [num_pairs, out] in x's dtype; zero rows for inactive pairs
    num_pairs = local_ids.numel()
    _, _, page_rank, in_features = lora_a.shape
    out_features = lora_b.shape[2]
    if lora_a.stride(-1) != 1 or lora_b.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("expert LoRA: the pool's A and B and the inputs need contiguous last dimensions")
    if x.shape[-1] != in_features or token_slots.numel() * top_k != num_pairs:
        raise ValueError(
            f"expert LoRA: inputs {tuple(x.shape)} with {token_slots.numel()} tokens x top-{top_k} do not "
            f"match {num_pairs} pairs of {in_features} input features"
        )
    out = torch.empty(num_pairs, out_features, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out
    block_r = triton.next_power_of_2(page_table.shape[1] * page_rank)
    block_k = min(max(16, TILE_ELEMENTS // block_r), triton.next_power_of_2(in_features))
    block_n = min(max(16, TILE_ELEMENTS // block_r), triton.next_power_of_2(out_features))
    _expert_lora_kernel[(num_pairs,)](
        out, x, lora_a, lora_b, page_table, token_slots, local_ids, local_ids if order is None else order,
        scales, ranks,
        in_features, out_features, num_local,
        out.stride(0), x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), page_table.stride(0),
        TOP_K=top_k, HAS_ORDER=order is not None, X_ROW_DIV=1 if per_pair_input else top_k, PAGE_RANK=page_rank,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        K_ITERS=triton.cdiv(in_features, block_k), N_ITERS=triton.cdiv(out_features, block_n),
        num_warps=4,
    )  # fmt: skip
    return out


# Pairs from which grouping them by (slot, expert) pays: a prefill's. Decode steps (up to 256 tokens
# x top-8) rarely share a pair and skip the sort. A shape test, so the same for every step of a shape.
ORDER_MIN_PAIRS = 4096


def pair_order(token_slots: torch.Tensor, local_ids: torch.Tensor, top_k: int, num_local: int):
    """[num_pairs] int64 pair ids grouped by (slot, expert), base-model and other ranks' pairs last;
    None below ORDER_MIN_PAIRS pairs."""
    if local_ids.numel() < ORDER_MIN_PAIRS:
        return None
    slots = token_slots.long().repeat_interleave(top_k)  # [P]
    ids = local_ids.long()
    inactive = (slots < 0) | (ids >= num_local)
    key = torch.where(inactive, torch.iinfo(torch.int64).max, slots * num_local + ids)
    return torch.argsort(key, stable=True)
