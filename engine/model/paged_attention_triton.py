"""Host wrapper of the Triton paged attention kernels: checks, tile sizes, split-K choice, launch.

Nothing here reads a device tensor back to the host, so a decode step that calls it can be captured
in a CUDA graph (the grid depends only on shapes and the host-side `max_query_len`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from engine.model.kv_quant import FP8_DTYPE
from engine.model.paged_attention_kernels import LOG2_E, combine_splits_kernel, paged_attention_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 16
# Decode wants a few programs per SM; each split beyond that only adds combine work.
PROGRAMS_PER_SM = 2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; 4 elsewhere, which keeps interpreted grids small."""
    return _num_sms(device.index) if device.type == "cuda" else 4


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key-range splits for a decode batch: enough (seq, kv head, split) programs to fill the GPU.

    Depends on the batch size only (not on sequence lengths), so an eager step and a CUDA-graph replay
    of the same batch size split identically and give bit-identical results.
    """
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_SPLITS, wanted))


def _fail(message: str) -> None:
    raise ValueError(message)


def _check(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale) -> None:
    if q.dim() != 3 or key_cache.dim() != 4:
        _fail(
            "q must be [num_tokens, num_heads, head_dim] and key_cache [num_blocks, block_size, "
            f"num_kv_heads, head_dim], got {tuple(q.shape)} and {tuple(key_cache.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    if value_cache.dtype != key_cache.dtype or key_cache.dtype not in (q.dtype, FP8_DTYPE):
        _fail(
            f"q ({q.dtype}), key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) must agree, "
            "or both caches be float8_e4m3fn"
        )
    if key_cache.dtype == FP8_DTYPE:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is None or t.dtype != torch.float32 or t.numel() != 1 or t.device != q.device:
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
                _fail(f"an fp8 cache needs {name} as a one-element float32 tensor on {q.device}, got {got}")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        _fail("value_cache must have the shape and strides of key_cache")
    if q.stride(2) != 1 or key_cache.stride(3) != 1:
        _fail("q and the caches need a contiguous head_dim (last dimension)")
    if q.shape[2] != key_cache.shape[3]:
        _fail(f"q has head_dim {q.shape[2]} but the cache {key_cache.shape[3]}")
    if q.shape[1] % key_cache.shape[2]:
        _fail(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({key_cache.shape[2]})")
    num_seqs = seq_lens.numel()
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        _fail(f"seq_lens must be 1-D int32, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,):
        _fail(
            f"query_start_loc must be int32 [num_seqs + 1] = [{num_seqs + 1}], got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.dim() != 2:
        _fail(
            f"block_tables must be 2-D int32 or int64, got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if block_tables.shape[0] < num_seqs or block_tables.stride(1) != 1:
        _fail(f"block_tables must have a row per sequence ({num_seqs}) and unit column stride")
    for t in (key_cache, value_cache, block_tables, seq_lens, query_start_loc):
        if t.device != q.device:
            _fail(f"all tensors must be on {q.device}, found one on {t.device}")
    if q.device.type != "cuda" and not interpreting():
        _fail("the Triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1); use backend 'torch'")


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,  # host-side: 1 for a decode-only batch
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,  # None: split the keys of decode batches (decode_num_splits), not prefill
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: torch.Tensor | None = None,  # [1] float32: stored K * k_scale = K; float8_e4m3fn caches only
    v_scale: torch.Tensor | None = None,  # [1] float32
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits (gpt-oss)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens (its last `query_len` tokens) over all its keys.

    The caches hold q's dtype, or float8 e4m3 with per-tensor scales (read on the device, never synced).
    """
    _check(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    fp8 = key_cache.dtype == FP8_DTYPE
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    num_seqs = seq_lens.numel()
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    if sliding_window is not None and sliding_window <= 0:
        _fail(f"sliding_window must be positive or None, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        _fail(f"softcap must be positive or None, got {softcap}")
    if sinks is not None and (
        sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,) or sinks.device != q.device
    ):
        _fail(f"sinks must be float32 [num_heads] = [{num_heads}] on {q.device}")
    per_kv = num_heads // num_kv_heads
    interpret = interpreting()
    decode = max_query_len == 1
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, q.device) if decode else 1
    # Rows = new tokens x query heads of a KV head; decode has one token, prefill fills 64 rows on GPU.
    block_m = (
        max(16, triton.next_power_of_2(per_kv))
        if decode or interpret
        else max(64, triton.next_power_of_2(per_kv))
    )
    block_q = block_m // per_kv
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    tile_n = 16 if interpret else (32 if decode else 64)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    if num_splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim_p), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    if not fp8:
        k_scale = v_scale = seq_lens  # unused
    paged_attention_kernel[grid](
        out,
        part_acc,
        part_max,
        part_sum,
        q,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        k_scale,
        v_scale,
        seq_lens if sinks is None else sinks,  # unused without sinks
        num_seqs,
        scale * LOG2_E,
        (softcap or 1.0) * LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=per_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        SLIDING_WINDOW=sliding_window or 0,
        NUM_SPLITS=num_splits,
        DOT_FP32=q.dtype == torch.float32 or interpret,
        KV_FP8=fp8,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        INTERPRET=interpret,
        num_warps=4,
    )
    if num_splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits,
            SPLITS_P=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
