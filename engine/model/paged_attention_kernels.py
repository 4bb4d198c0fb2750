"""Triton paged attention: causal attention of a step's new tokens over K/V read through block tables.

One kernel serves decode, prefill and chunked prefill. A program owns one *query block* of one
sequence and one KV head: BLOCK_Q consecutive new tokens x the NUM_QUERIES_PER_KV query heads that
share that KV head (GQA), packed into BLOCK_M rows, so K/V tiles are loaded once for the whole group.
It walks the sequence's keys TILE_N at a time, gathering each key's cache slot through the block table
(so TILE_N does not depend on the cache block size), with an online softmax in float32.

Query blocks need no host bookkeeping: program `pid` belongs to the last sequence s with
`query_start_loc[s] // BLOCK_Q + s <= pid` (binary search), which gives every sequence at least
ceil(query_len / BLOCK_Q) programs within a grid of `num_tokens // BLOCK_Q + num_seqs`. Example,
BLOCK_Q = 4, query lengths [1, 6, 3] -> query_start_loc [0, 1, 7, 10]:
    first block of seq s = [0 // 4 + 0, 1 // 4 + 1, 7 // 4 + 2] = [0, 1, 3]; grid = 10 // 4 + 3 = 5
    pid 0 -> seq 0 (tokens 0..0); pid 1, 2 -> seq 1 (tokens 1..4, 5..6); pid 3 -> seq 2 (7..9);
    pid 4 -> seq 2, local block 1 starts past its 3 tokens: returns at once.

Split-K (flash-decoding): with NUM_SPLITS > 1 each sequence's key range is cut into NUM_SPLITS
chunks, one program each; they write unnormalised partial outputs with their running max and sum,
and `_combine_splits_kernel` merges them. Small decode batches over long contexts use it to fill the GPU.

Attention sinks (SINKS, gpt-oss): each head's learned logit joins the softmax's denominator with no
value; it seeds the running max and sum (exp2(sink - sink) = 1) of split 0, so splits combine unchanged.

fp8 caches (KV_FP8): K/V tiles are float8 e4m3, converted exactly to the query dtype after the load;
the K scale is folded into `qk_scale` and the V scale into the accumulator, both in float32, so the
dots see the stored values and the scales cost two multiplies per program (see kv_quant.py).

Under TRITON_INTERPRET=1 scalars loaded from memory cannot bound a `for` loop, so the key loop is a
`while` loop there (INTERPRET); on the GPU it is a `for` loop that Triton can software-pipeline.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first query block (`query_start_loc[s] // BLOCK_Q + s`) is <= q_block_id."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh in float32 through exp2 (Triton has no tanh of its own)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2.885... = 2 * log2(e)


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_P] float32, unnormalised output
    m_i,  # [BLOCK_M] float32, running max of the log2-scaled scores
    l_i,  # [BLOCK_M] float32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM_P]
    q_pos,  # [BLOCK_M] position of each row's token in its sequence
    tile_start,
    key_hi,  # keys at positions >= key_hi are not read
    table_ptr,  # this sequence's block table row
    k_cache_ptr,
    v_cache_ptr,
    head_offset,  # kv_head * stride_kh
    qk_scale,  # softmax scale * log2(e)
    softcap,  # the soft cap * log2(e), read if SOFTCAP
    stride_kb,
    stride_ks,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    keys = tile_start + tl.arange(0, TILE_N)  # [TILE_N] key positions
    key_valid = keys < key_hi
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    slot = block * stride_kb + (keys % BLOCK_SIZE) * stride_ks + head_offset  # [TILE_N]
    k_mask = key_valid[None, :] & dim_valid[:, None]
    k = tl.load(k_cache_ptr + slot[None, :] + dims[:, None], mask=k_mask, other=0.0)  # [HEAD_DIM_P, TILE_N]
    v_mask = key_valid[:, None] & dim_valid[None, :]
    v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=v_mask, other=0.0)  # [TILE_N, HEAD_DIM_P]
    if KV_FP8:
        # Exact: every e4m3 value is a float16/bfloat16/float32 value; the scales are applied by the caller.
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale  # [BLOCK_M, TILE_N]
    if SOFTCAP:  # cap * tanh(score / cap), in log2 units: the scale by log2(e) commutes with it
        s = softcap * _tanh(s / softcap)
    allowed = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
    if SLIDING_WINDOW > 0:
        allowed = allowed & (keys[None, :] > q_pos[:, None] - SLIDING_WINDOW)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no allowed key yet keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


# Per-step values: specialising on them (== 1, divisible by 16) would compile new variants mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim], written when NUM_SPLITS == 1
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_P] float32, written when NUM_SPLITS > 1
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache_ptr,  # same layout and strides as k_cache
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs] int32, cached + new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32
    k_scale_ptr,  # [1] float32, read when KV_FP8
    v_scale_ptr,  # [1] float32, read when KV_FP8
    sinks_ptr,  # [num_heads] float32 sink logits, read when SINKS
    num_seqs,
    qk_scale,
    softcap,  # attention logit soft cap * log2(e) (Gemma 2), read if SOFTCAP
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * NUM_QUERIES_PER_KV, a power of two >= 16
    TILE_N: tl.constexpr,  # keys per loop step
    SLIDING_WINDOW: tl.constexpr,  # 0: full attention
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold float8 e4m3 scaled by k_scale / v_scale
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,  # a per-head logit in every softmax's denominator, with no value (gpt-oss)
    INTERPRET: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_q = (q_block_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of this block
    if first_q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # the new tokens are the last query_len of the sequence

    rows = tl.arange(0, BLOCK_M)
    q_local = first_q + rows // NUM_QUERIES_PER_KV  # [BLOCK_M] new-token index within the sequence
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_local < query_len)
    q_pos = context_len + q_local
    token = (q_start + q_local).to(tl.int64)  # [BLOCK_M] row in q / out
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    io_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_P]

    # Keys this block may see: causal up to its last token, and within the window of its first.
    last_q = tl.minimum(first_q + BLOCK_Q, query_len) - 1
    key_hi = context_len + last_q + 1
    key_lo = key_hi * 0
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(context_len + first_q - SLIDING_WINDOW + 1, 0)
    per_split = tl.cdiv(tl.cdiv(key_hi - key_lo, NUM_SPLITS), TILE_N) * TILE_N
    split_lo = key_lo + split * per_split
    split_hi = tl.minimum(key_hi, split_lo + per_split)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink starts the online softmax as a key of score `sink` and value 0 (split 0 only)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(split == 0, 1.0, 0.0) + l_i
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_kh
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # scores of the stored K times k_scale
    if INTERPRET:
        tile_start = split_lo
        while tile_start < split_hi:
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                tile_start,
                split_hi,
                table_ptr,
                k_cache_ptr,
                v_cache_ptr,
                head_offset,
                qk_scale,
                softcap,
                stride_kb,
                stride_ks,
                HEAD_DIM,
                HEAD_DIM_P,
                BLOCK_SIZE,
                TILE_N,
                SLIDING_WINDOW,
                DOT_FP32,
                KV_FP8,
                SOFTCAP,
            )
            tile_start += TILE_N
    else:
        for tile_start in range(split_lo, split_hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                tile_start,
                split_hi,
                table_ptr,
                k_cache_ptr,
                v_cache_ptr,
                head_offset,
                qk_scale,
                softcap,
                stride_kb,
                stride_ks,
                HEAD_DIM,
                HEAD_DIM_P,
                BLOCK_SIZE,
                TILE_N,
                SLIDING_WINDOW,
                DOT_FP32,
                KV_FP8,
                SOFTCAP,
            )
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)  # sum of p * stored V, times v_scale: linear, so splits may combine

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (token * (NUM_QUERIES_PER_KV * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def combine_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_P] float32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    """One program per (token, head): rescale each split's partial to the common max and normalise."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * num_heads + head
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < NUM_SPLITS
    m = tl.load(part_max_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)  # finite: every token sees at least itself
    weight = tl.math.exp2(m - m_max)  # [SPLITS_P], 0 for empty splits (max -inf)
    total = tl.sum(weight * l_s, 0)
    dims = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(
        part_acc_ptr + (row * NUM_SPLITS + splits[:, None]) * HEAD_DIM_P + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )  # [SPLITS_P, HEAD_DIM_P]
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
