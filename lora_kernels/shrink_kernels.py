"""Shrink, `h = x @ A[slot]^T` per token: the gathered (BGMV-like) and segmented (SGMV-like) kernels.

Both write float32 partial sums `h[split, slice, token, :max_rank]` over one K range each (split-K): rank
16 leaves too few output values per token to occupy an H100 otherwise, and the expand kernel adds the
partials up while it reads h, so split-K costs no extra launch, no atomics and no zero-fill. Every
(split, slice, token) row is written: zeros for tokens without an adapter and past a slot's rank, so h
never holds stale values.

A slot of rank r < max_rank loads only its first r rows of A (a mask that is constant along K, so loads
stay 16-byte vectors): a rank-8 adapter in a max-rank-64 pool reads 1/8 of the bytes.

Two layouts of A (`rank_rows`): dense stacks `[num_slots, max_rank, in]` (the public `add_lora`), or a
paged pool (PAGED): `[num_pages, PAGE, in]` pages of PAGE rank rows, slot s's row r in page
`page_table[s, r // PAGE]`. A program reads its slot's page ids once, into per-row base offsets, before
the K loop; the loop itself is the same in both layouts (rows are contiguous along K either way).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def pick(i, v0, v1, v2):
    """`(v0, v1, v2)[i]` for a runtime slice index (Triton has no runtime indexing of argument lists).

    `+ zero` turns arguments Triton specialised to constants (an int equal to 1) into runtime values, so
    both sides of the branch have one type.
    """
    zero = i * 0
    v = v2 + zero
    if i == 0:
        v = v0 + zero
    elif i == 1:
        v = v1 + zero
    return v


@triton.jit
def rank_rows(
    slot,
    offs_r,  # [BLOCK_R] rank rows
    stride,  # dense: slot stride; paged: page stride; in units of SLOT_ALIGN
    row_stride,  # elements between consecutive rank rows of one slot (within one page when paged)
    page_table_ptr,  # [num_slots, max_pages] int32, read only if PAGED
    page_table_stride,
    MAX_RANK: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,  # rank rows per page
    SLOT_ALIGN: tl.constexpr,
):
    """Element offset of each rank row of `slot` ([BLOCK_R] int64), computed once per program.

    Paged, the page ids are read up to MAX_RANK, not the slot's rank: ids past the slot's pages may be
    stale, but the rows they address are masked off by the rank, and the load does not wait for the
    rank's, so the weights' loads start as early as over a dense stack.
    """
    if PAGED:
        page = tl.load(
            page_table_ptr + slot.to(tl.int64) * page_table_stride + offs_r // PAGE,
            mask=offs_r < MAX_RANK,
            other=0,
        )
        rows = page.to(tl.int64) * (stride * SLOT_ALIGN) + (offs_r % PAGE) * row_stride
    else:
        rows = slot.to(tl.int64) * (stride * SLOT_ALIGN) + offs_r * row_stride
    return rows


@triton.jit
def _shrink_gathered_kernel(
    x_ptr,  # [num_tokens, in]
    a0_ptr,  # [num_slots, max_rank, in] with slot stride stride_a0, slice 0 (1 and 2 likewise; unused repeat 0)
    a1_ptr,
    a2_ptr,
    h_ptr,  # [split_k, num_slices, num_tokens, max_rank] float32, rank contiguous
    token_slots_ptr,  # [num_tokens] int32
    slot_ranks_ptr,  # [num_slots] int32, read only if HAS_RANKS
    page_table_ptr,  # [num_slots, max_pages] int32, read only if PAGED
    page_table_stride,
    in_features,
    stride_xt,
    stride_hk,
    stride_hs,
    stride_ht,
    stride_a0,  # slot (dense) or page (PAGED) stride of each slice's A over SLOT_ALIGN
    stride_a1,
    stride_a2,
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,  # divides every slot stride: keeps loads vectorized past the runtime pick
    BLOCK_R: tl.constexpr,  # next power of two >= max(max_rank, 16)
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,  # K blocks per split (constexpr: the interpreter cannot loop to a runtime bound)
    HAS_RANKS: tl.constexpr,
    PAGED: tl.constexpr,  # A in pages of PAGE rank rows through the page table (else dense stacks)
    PAGE: tl.constexpr,
    USE_PDL: tl.constexpr,
    RANK_WINDOW: tl.constexpr = False,  # only tokens whose slot rank is in (rank_lo, MAX_RANK]
    rank_lo=0,
):
    """One program per (slice, split, token): a [BLOCK_R, BLOCK_K] tile of the token's A against x[t]."""
    slice_id = tl.program_id(0)
    split = tl.program_id(1)
    token = tl.program_id(2).to(tl.int64)
    if USE_PDL:
        gdc_launch_dependents()  # let the expand kernel start loading B while this grid runs
    offs_r = tl.arange(0, BLOCK_R)
    h_row = h_ptr + split * stride_hk + slice_id * stride_hs + token * stride_ht + offs_r
    slot = tl.load(token_slots_ptr + token)
    if slot < 0:
        tl.store(h_row, tl.zeros((BLOCK_R,), tl.float32), mask=offs_r < MAX_RANK)
        return
    rank = MAX_RANK
    if HAS_RANKS:
        rank = tl.load(slot_ranks_ptr + slot)
        if RANK_WINDOW:
            if (rank <= rank_lo) | (rank > MAX_RANK):
                return  # another launch of this op serves it; its h row stays unread
        rank = tl.minimum(rank, MAX_RANK)
    a_ptr = a0_ptr
    stride_a = stride_a0
    if NUM_SLICES > 1:
        a_ptr = pick(slice_id, a0_ptr, a1_ptr, a2_ptr)
        stride_a = pick(slice_id, stride_a0, stride_a1, stride_a2)
    rows = rank_rows(
        slot,
        offs_r,
        stride_a,
        in_features,
        page_table_ptr,
        page_table_stride,
        MAX_RANK,
        PAGED,
        PAGE,
        SLOT_ALIGN,
    )
    a_rows = a_ptr + rows[:, None]
    r_ok = offs_r[:, None] < rank
    offs_k = split * (K_ITERS * BLOCK_K) + tl.arange(0, BLOCK_K)
    # Products summed elementwise, reduced across K once at the end: one shuffle tree, not one per block.
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    for _ in range(K_ITERS):
        k_ok = offs_k < in_features
        xv = tl.load(x_ptr + token * stride_xt + offs_k, mask=k_ok, other=0.0)
        av = tl.load(a_rows + offs_k[None, :], mask=r_ok & k_ok[None, :], other=0.0)
        acc += av.to(tl.float32) * xv.to(tl.float32)[None, :]
        offs_k += BLOCK_K
    tl.store(h_row, tl.sum(acc, axis=1), mask=offs_r < MAX_RANK)


@triton.jit
def _shrink_segmented_kernel(
    x_ptr,  # [num_tokens, in]
    a0_ptr,  # [num_slots, max_rank, in] per slice, as above
    a1_ptr,
    a2_ptr,
    h_ptr,  # [split_k, num_slices, num_tokens, max_rank] float32, rank contiguous
    slot_ranks_ptr,  # [num_slots] int32, read only if HAS_RANKS
    sorted_tokens_ptr,  # [max_tokens] int32, LoRABatchMeta.sorted_tokens
    tile_slot_ptr,  # [max_tiles] int32
    tile_start_ptr,  # [max_tiles] int32
    tile_len_ptr,  # [max_tiles] int32
    page_table_ptr,  # [num_slots, max_pages] int32, read only if PAGED
    page_table_stride,
    in_features,
    stride_xt,
    stride_hk,
    stride_hs,
    stride_ht,
    stride_a0,
    stride_a1,
    stride_a2,
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,  # LoRABatchMeta.block_m
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 inputs, or the interpreter (whose bf16 tl.dot is wrong)
    USE_PDL: tl.constexpr,
    RANK_WINDOW: tl.constexpr = False,  # only tiles whose slot rank is in (rank_lo, MAX_RANK]
    rank_lo=0,
):
    """One program per (slice, split, tile): up to BLOCK_M tokens of one slot, so A is read once per tile."""
    slice_id = tl.program_id(0)
    split = tl.program_id(1)
    tile = tl.program_id(2)
    if USE_PDL:
        gdc_launch_dependents()
    num_rows = tl.load(tile_len_ptr + tile)
    if num_rows == 0:
        return
    slot = tl.load(tile_slot_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < num_rows
    tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    h_tile = h_ptr + split * stride_hk + slice_id * stride_hs + tokens[:, None] * stride_ht + offs_r[None, :]
    h_mask = m_ok[:, None] & (offs_r[None, :] < MAX_RANK)
    if slot < 0:
        tl.store(h_tile, tl.zeros((BLOCK_M, BLOCK_R), tl.float32), mask=h_mask)
        return
    rank = MAX_RANK
    if HAS_RANKS:
        rank = tl.load(slot_ranks_ptr + slot)
        if RANK_WINDOW:
            if (rank <= rank_lo) | (rank > MAX_RANK):
                return
        rank = tl.minimum(rank, MAX_RANK)
    a_ptr = a0_ptr
    stride_a = stride_a0
    if NUM_SLICES > 1:
        a_ptr = pick(slice_id, a0_ptr, a1_ptr, a2_ptr)
        stride_a = pick(slice_id, stride_a0, stride_a1, stride_a2)
    rows = rank_rows(
        slot,
        offs_r,
        stride_a,
        in_features,
        page_table_ptr,
        page_table_stride,
        MAX_RANK,
        PAGED,
        PAGE,
        SLOT_ALIGN,
    )
    a_rows = a_ptr + rows[:, None]
    x_rows = x_ptr + tokens[:, None] * stride_xt
    r_ok = offs_r[:, None] < rank
    offs_k = split * (K_ITERS * BLOCK_K) + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    for _ in range(K_ITERS):
        k_ok = offs_k[None, :] < in_features
        xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
        av = tl.load(a_rows + offs_k[None, :], mask=r_ok & k_ok, other=0.0)  # [BLOCK_R, BLOCK_K]
        if DOT_FP32:
            acc = tl.dot(xv.to(tl.float32), tl.trans(av.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(av), acc)
        offs_k += BLOCK_K
    tl.store(h_tile, acc, mask=h_mask)


def slot_alignment(stacks) -> int:
    """The largest of 16, 8, 4, 2, 1 that divides every slot stride: passed as a constexpr factor, so
    Triton still knows slot offsets are aligned after a slice's stride is picked at run time."""
    return math.gcd(16, *(t.stride(0) for t in stacks))


def launch_shrink(
    h, x, lora_as, token_slots, slot_ranks, meta, path, config, page_table=None, rank_lo=None
) -> None:
    """Launch one shrink kernel for all slices; `config` is a ShrinkConfig from tiles.py. With a
    `page_table` ([num_slots, max_pages] int32), `lora_as` are pools of pages [num_pages, PAGE, in].
    With `rank_lo`, only tokens whose slot rank lies in (rank_lo, max_rank] are computed (their h rows
    written); the others are left to another launch."""
    num_slices = len(lora_as)
    a = list(lora_as) + [lora_as[0]] * (3 - num_slices)
    ranks = slot_ranks if slot_ranks is not None else token_slots
    paged = page_table is not None
    table = page_table if paged else token_slots
    in_features = x.shape[1]
    align = slot_alignment(a)
    common = dict(
        NUM_SLICES=num_slices,
        MAX_RANK=page_table.shape[1] * lora_as[0].shape[1] if paged else lora_as[0].shape[1],
        SLOT_ALIGN=align,
        BLOCK_R=config.block_r,
        BLOCK_K=config.block_k,
        K_ITERS=config.k_per_split // config.block_k,
        HAS_RANKS=slot_ranks is not None,
        PAGED=paged,
        PAGE=lora_as[0].shape[1] if paged else 1,
        USE_PDL=config.use_pdl,
        num_warps=config.num_warps,
    )
    if rank_lo is not None:
        common.update(RANK_WINDOW=True, rank_lo=rank_lo)
    table_stride = table.stride(0) if paged else 0
    strides = (x.stride(0), h.stride(0), h.stride(1), h.stride(2), *(t.stride(0) // align for t in a))
    if path == "gathered":
        grid = (num_slices, config.split_k, x.shape[0])
        _shrink_gathered_kernel[grid](
            x, *a, h, token_slots, ranks, table, table_stride, in_features, *strides, **common
        )
    else:
        grid = (num_slices, config.split_k, meta.num_tiles)
        _shrink_segmented_kernel[grid](
            x,
            *a,
            h,
            ranks,
            meta.sorted_tokens,
            meta.tile_slot,
            meta.tile_start,
            meta.tile_len,
            table,
            table_stride,
            in_features,
            *strides,
            BLOCK_M=meta.block_m,
            DOT_FP32=config.dot_fp32,
            **common,
        )
