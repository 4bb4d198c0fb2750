"""Expand, `y += scale * h @ B[slot]^T` per token: the gathered and segmented kernels.

h arrives as float32 split-K partials `[split_k, num_slices, num_tokens, max_rank]` (split_k = 1 for a
plain h) and is summed here. The output blocks of all slices of a fused projection form one grid axis:
block ids [0, tiles0) are slice 0, [tiles0, tiles0 + tiles1) slice 1, the rest slice 2.

With programmatic dependent launch (USE_PDL, sm90+), a program loads its B block and y block first and
only then waits for the shrink grid (`gdc_wait`) before reading h, so B's bytes, the larger half of the
LoRA traffic at decode, stream in while the shrink kernel still runs. B and h are read up to the slot's
rank rounded up to 16 and capped at max_rank (a mask constant over 16 contiguous ranks keeps the loads
vectorized); between the rank and that limit B is zero padding (the layout contract of `add_lora`), so
the result is the same.

Paged pools (PAGED) hold B as `[num_pages, out, PAGE]`: for each output column, PAGE consecutive ranks
per page, slot s's rank r in page `page_table[s, r // PAGE]` (shrink_kernels.rank_rows). The B block of
a program is then laid out as over a dense stack, ranks innermost, in runs of PAGE (16 bytes in bf16:
one vector load), so it compiles to the same loads, registers and reduction as the dense kernel (B^T
pages, contiguous along the output columns, made Triton spread the ranks over warps and reduce them
through shared memory). B and h are read up to the rank rounded up to a whole page, never past the
slot's own pages; the pool keeps B zero past the rank within that last page.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from lora_kernels.shrink_kernels import pick, rank_rows, slot_alignment


@triton.jit
def _slice_of_block(pid_n, tiles0, tiles1, BLOCK_N: tl.constexpr):
    """(slice, first output column within the slice) of output block `pid_n`, without branches."""
    past0 = (pid_n >= tiles0).to(tl.int32)
    past1 = (pid_n >= tiles0 + tiles1).to(tl.int32)
    return past0 + past1, (pid_n - past0 * tiles0 - past1 * tiles1) * BLOCK_N


@triton.jit
def _load_b(
    b0_ptr,
    b1_ptr,
    b2_ptr,
    slice_id,
    slot,
    n0,
    w0,
    w1,
    w2,
    sb0,
    sb1,
    sb2,
    slot_ranks_ptr,
    page_table_ptr,
    page_table_stride,
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    """B[slot, n0:n0+BLOCK_N, :] of the slice as [BLOCK_N, BLOCK_R], plus (width, column offset, rank limit)."""
    b_ptr = b0_ptr
    width = w0
    stride_b = sb0
    col0 = 0
    if NUM_SLICES > 1:
        b_ptr = pick(slice_id, b0_ptr, b1_ptr, b2_ptr)
        width = pick(slice_id, w0, w1, w2)
        stride_b = pick(slice_id, sb0, sb1, sb2)
        col0 = pick(slice_id, 0, w0, w0 + w1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_limit = MAX_RANK
    b_mask = offs_n[:, None] < width
    if HAS_RANKS:
        # The rank rounded up to a whole vector of ranks (16; a page when paged, so the read stays in the
        # slot's own pages), where B is zero: a mask constant over it keeps the loads 16-byte vectors.
        r_round = PAGE if PAGED else 16
        r_limit = tl.minimum((tl.load(slot_ranks_ptr + slot) + r_round - 1) // r_round * r_round, MAX_RANK)
        b_mask &= offs_r[None, :] < r_limit
    elif BLOCK_R != MAX_RANK:
        b_mask &= offs_r[None, :] < MAX_RANK
    # Column offset of each rank in its page (paged: ranks of one page are contiguous, PAGE of them per
    # output column) or in the slot's block; output column n adds n * (PAGE or MAX_RANK).
    rows = rank_rows(
        slot, offs_r, stride_b, 1, page_table_ptr, page_table_stride, MAX_RANK, PAGED, PAGE, SLOT_ALIGN
    )
    if PAGED:
        # Runs of SLOT_ALIGN consecutive ranks (it divides PAGE here) starting at multiples of it: say so,
        # or Triton, which cannot see through the page ids, would load B one element at a time.
        rows = tl.max_contiguous(tl.multiple_of(rows, SLOT_ALIGN), SLOT_ALIGN)
        b = tl.load(b_ptr + rows[None, :] + offs_n[:, None] * PAGE, mask=b_mask, other=0.0)
    else:
        b = tl.load(b_ptr + rows[None, :] + offs_n[:, None] * MAX_RANK, mask=b_mask, other=0.0)
    return b, width, col0, r_limit


@triton.jit
def _expand_gathered_kernel(
    y_ptr,  # [num_tokens, sum(output_slices)], row stride stride_yt, unit column stride
    h_ptr,  # [split_k, num_slices, num_tokens, max_rank] float32
    b0_ptr,  # [num_slots, output_slices[0], max_rank], slice 0 (1 and 2 likewise, unused repeat slice 0)
    b1_ptr,
    b2_ptr,
    s0_ptr,  # [num_slots] float32 scales of slice 0 (1 and 2 likewise)
    s1_ptr,
    s2_ptr,
    token_slots_ptr,  # [num_tokens] int32
    slot_ranks_ptr,  # [num_slots] int32, read only if HAS_RANKS
    page_table_ptr,  # [num_slots, max_pages] int32, read only if PAGED
    page_table_stride,
    w0,
    w1,
    w2,  # output_slices
    sb0,
    sb1,
    sb2,  # slot strides of each slice's B over SLOT_ALIGN (width * max_rank for a dense stack)
    tiles0,
    tiles1,  # output blocks of slices 0 and 1
    stride_yt,
    stride_hk,
    stride_hs,
    stride_ht,
    SPLIT_K: tl.constexpr,  # partials of h to sum
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,  # divides every slot stride (shrink_kernels.slot_alignment)
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    PAGED: tl.constexpr,  # B in pages of PAGE ranks through the page table (else dense stacks)
    PAGE: tl.constexpr,
    USE_PDL: tl.constexpr,
    RANK_WINDOW: tl.constexpr = False,  # only tokens whose slot rank is in (rank_lo, MAX_RANK]
    rank_lo=0,
):
    """One program per (output block, token); rank is tiny, so a broadcast-multiply-sum beats tl.dot."""
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    slot = tl.load(token_slots_ptr + token)
    if slot < 0:
        return
    if RANK_WINDOW:
        rank = tl.load(slot_ranks_ptr + slot)
        if (rank <= rank_lo) | (rank > MAX_RANK):
            return  # another launch of this op serves it
    slice_id, n0 = _slice_of_block(pid_n, tiles0, tiles1, BLOCK_N)
    b, width, col0, r_limit = _load_b(
        b0_ptr,
        b1_ptr,
        b2_ptr,
        slice_id,
        slot,
        n0,
        w0,
        w1,
        w2,
        sb0,
        sb1,
        sb2,
        slot_ranks_ptr,
        page_table_ptr,
        page_table_stride,
        NUM_SLICES,
        MAX_RANK,
        SLOT_ALIGN,
        BLOCK_N,
        BLOCK_R,
        HAS_RANKS,
        PAGED,
        PAGE,
    )
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    y_row = y_ptr + token * stride_yt + col0 + offs_n
    yv = tl.load(y_row, mask=n_ok, other=0.0)
    scale_ptr = s0_ptr
    if NUM_SLICES > 1:
        scale_ptr = pick(slice_id, s0_ptr, s1_ptr, s2_ptr)
    scale = tl.load(scale_ptr + slot)
    if USE_PDL:
        gdc_wait()  # h is written by the shrink grid
    offs_r = tl.arange(0, BLOCK_R)
    h_row = h_ptr + slice_id * stride_hs + token * stride_ht + offs_r
    hv = tl.zeros((BLOCK_R,), tl.float32)
    for k in tl.static_range(SPLIT_K):  # unrolled: the partials' loads issue together, not in turn
        hv += tl.load(h_row + k * stride_hk, mask=offs_r < r_limit, other=0.0)
    out = tl.sum(b.to(tl.float32) * hv[None, :], axis=1)
    tl.store(y_row, (yv.to(tl.float32) + scale * out).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _expand_segmented_kernel(
    y_ptr,  # [num_tokens, sum(output_slices)]
    h_ptr,  # [split_k, num_slices, num_tokens, max_rank] float32
    b0_ptr,  # [num_slots, output_slices[i], max_rank] per slice, as above
    b1_ptr,
    b2_ptr,
    s0_ptr,  # [num_slots] float32 per slice
    s1_ptr,
    s2_ptr,
    slot_ranks_ptr,  # [num_slots] int32
    page_table_ptr,  # [num_slots, max_pages] int32, read only if PAGED
    page_table_stride,
    sorted_tokens_ptr,  # [max_tokens] int32, LoRABatchMeta
    tile_slot_ptr,  # [max_tiles] int32
    tile_start_ptr,  # [max_tiles] int32
    tile_len_ptr,  # [max_tiles] int32
    w0,
    w1,
    w2,
    sb0,
    sb1,
    sb2,
    tiles0,
    tiles1,
    stride_yt,
    stride_hk,
    stride_hs,
    stride_ht,
    SPLIT_K: tl.constexpr,  # partials of h to sum
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,  # divides every slot stride (shrink_kernels.slot_alignment)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_RANKS: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
    RANK_WINDOW: tl.constexpr = False,  # only tiles whose slot rank is in (rank_lo, MAX_RANK]
    rank_lo=0,
):
    """One program per (output block, tile of one slot's tokens): B's block is read once per tile."""
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    num_rows = tl.load(tile_len_ptr + tile)
    slot = tl.load(tile_slot_ptr + tile)
    if (num_rows == 0) | (slot < 0):
        return
    if RANK_WINDOW:
        rank = tl.load(slot_ranks_ptr + slot)
        if (rank <= rank_lo) | (rank > MAX_RANK):
            return
    slice_id, n0 = _slice_of_block(pid_n, tiles0, tiles1, BLOCK_N)
    b, width, col0, r_limit = _load_b(
        b0_ptr,
        b1_ptr,
        b2_ptr,
        slice_id,
        slot,
        n0,
        w0,
        w1,
        w2,
        sb0,
        sb1,
        sb2,
        slot_ranks_ptr,
        page_table_ptr,
        page_table_stride,
        NUM_SLICES,
        MAX_RANK,
        SLOT_ALIGN,
        BLOCK_N,
        BLOCK_R,
        HAS_RANKS,
        PAGED,
        PAGE,
    )
    start = tl.load(tile_start_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < num_rows
    tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    y_tile = y_ptr + tokens[:, None] * stride_yt + col0 + offs_n[None, :]
    y_mask = m_ok[:, None] & (offs_n[None, :] < width)
    yv = tl.load(y_tile, mask=y_mask, other=0.0)
    scale_ptr = s0_ptr
    if NUM_SLICES > 1:
        scale_ptr = pick(slice_id, s0_ptr, s1_ptr, s2_ptr)
    scale = tl.load(scale_ptr + slot)
    if USE_PDL:
        gdc_wait()
    h_tile = h_ptr + slice_id * stride_hs + tokens[:, None] * stride_ht + offs_r[None, :]
    h_mask = m_ok[:, None] & (offs_r[None, :] < r_limit)
    hv = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    if SPLIT_K * BLOCK_M * BLOCK_R <= 8192:
        for k in tl.static_range(SPLIT_K):  # unrolled while all partials fit in registers at once
            hv += tl.load(h_tile + k * stride_hk, mask=h_mask, other=0.0)
    else:
        for k in range(SPLIT_K):
            hv += tl.load(h_tile + k * stride_hk, mask=h_mask, other=0.0)
    if DOT_FP32:
        out = tl.dot(hv, tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        # h split into a high and a low half-precision part: tensor cores at nearly float32 accuracy.
        hi = hv.to(b.dtype)
        lo = (hv - hi.to(tl.float32)).to(b.dtype)
        out = tl.dot(hi, tl.trans(b))
        out = tl.dot(lo, tl.trans(b), out)
    tl.store(y_tile, (yv.to(tl.float32) + scale * out).to(y_ptr.dtype.element_ty), mask=y_mask)


def launch_expand(
    y,
    h,
    lora_bs,
    scales,
    token_slots,
    slot_ranks,
    output_slices,
    meta,
    path,
    config,
    page_table=None,
    rank_lo=None,
) -> None:
    """Launch one expand kernel for all slices; `config` is an ExpandConfig from tiles.py. With a
    `page_table` ([num_slots, max_pages] int32), `lora_bs` are pools of B pages [num_pages, out, PAGE].
    With `rank_lo`, only tokens whose slot rank lies in (rank_lo, max_rank] are updated."""
    num_slices = len(lora_bs)
    b = list(lora_bs) + [lora_bs[0]] * (3 - num_slices)
    s = list(scales) + [scales[0]] * (3 - num_slices)
    widths = list(output_slices) + [0] * (3 - num_slices)
    tiles = [triton.cdiv(w, config.block_n) for w in widths]
    ranks = slot_ranks if slot_ranks is not None else token_slots
    paged = page_table is not None
    table = page_table if paged else token_slots
    # Paged, the alignment also divides the page, so it is the length of the runs of contiguous ranks.
    align = math.gcd(slot_alignment(b), b[0].shape[2]) if paged else slot_alignment(b)
    common = dict(
        SPLIT_K=h.shape[0],
        NUM_SLICES=num_slices,
        MAX_RANK=page_table.shape[1] * lora_bs[0].shape[2] if paged else lora_bs[0].shape[2],
        SLOT_ALIGN=align,
        BLOCK_N=config.block_n,
        BLOCK_R=config.block_r,
        HAS_RANKS=slot_ranks is not None,
        PAGED=paged,
        PAGE=lora_bs[0].shape[2] if paged else 1,
        USE_PDL=config.use_pdl,
        num_warps=config.num_warps,
    )
    if config.use_pdl:
        common["launch_pdl"] = True
    if rank_lo is not None:
        common.update(RANK_WINDOW=True, rank_lo=rank_lo)
    slot_strides = [t.stride(0) // align for t in b]
    tail = (*widths, *slot_strides, tiles[0], tiles[1], y.stride(0), h.stride(0), h.stride(1), h.stride(2))
    paging = (table, table.stride(0) if paged else 0)
    if path == "gathered":
        grid = (sum(tiles), y.shape[0])
        _expand_gathered_kernel[grid](y, h, *b, *s, token_slots, ranks, *paging, *tail, **common)
    else:
        grid = (sum(tiles), meta.num_tiles)
        _expand_segmented_kernel[grid](
            y,
            h,
            *b,
            *s,
            ranks,
            *paging,
            meta.sorted_tokens,
            meta.tile_slot,
            meta.tile_start,
            meta.tile_len,
            *tail,
            BLOCK_M=meta.block_m,
            DOT_FP32=config.dot_fp32,
            **common,
        )
