"""Triton paged attention (interpreted on the CPU) against a float64 reference: decode, prefill, chunked
prefill over a cached prefix, GQA, odd head sizes, several block sizes, sliding windows, split-K."""

from __future__ import annotations

import zlib

import pytest
import torch
from paged_attention_cases import make_batch, reference_attention

from engine.model.paged_attention_triton import paged_attention_triton

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def run(batch, scale, window=None, num_splits=None):
    seq_lens, starts = batch.device_meta()
    out = torch.full_like(batch.q, float("nan"))
    result = paged_attention_triton(
        batch.q,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        seq_lens,
        starts,
        max(batch.query_lens),
        scale,
        window,
        num_splits=num_splits,
        out=out,
    )
    assert result is out
    return out


CASES = {
    # name: (seqs as (cached, new), num_heads, num_kv_heads, head_dim, block_size, window, splits)
    "decode_gqa4": ([(5, 1), (17, 1), (0, 1)], 4, 1, 16, 8, None, None),
    "decode_split_k": ([(37, 1), (3, 1)], 2, 2, 16, 4, None, 3),
    "prefill_mha_odd_head": ([(0, 7), (0, 19)], 3, 3, 24, 16, None, None),
    "chunked_prefill_gqa3": ([(9, 6), (0, 1), (20, 4)], 6, 2, 16, 8, None, None),
    "mixed_with_window": ([(13, 5), (30, 1), (0, 11)], 4, 2, 16, 4, 6, None),
    "decode_window_split_k": ([(40, 1), (2, 1)], 4, 2, 32, 16, 9, 2),
    "block_size_32": ([(33, 2), (1, 1)], 2, 1, 16, 32, None, None),
}


@pytest.mark.interpreted
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference(name):
    seqs, heads, kv_heads, head_dim, block_size, window, splits = CASES[name]
    batch = make_batch(
        seqs, heads, kv_heads, head_dim, block_size, torch.float32, seed=zlib.crc32(name.encode())
    )
    scale = head_dim**-0.5
    out = run(batch, scale, window, splits)
    expected = reference_attention(batch, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    batch = make_batch([(11, 3), (4, 1)], 4, 2, 16, 8, dtype, seed=7)
    out = run(batch, 0.25)
    expected = reference_attention(batch, 0.25, None)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.interpreted
def test_split_k_equals_one_split():
    batch = make_batch([(45, 1), (12, 1), (1, 1)], 4, 2, 16, 8, torch.float32, seed=3)
    one, many = run(batch, 0.3, num_splits=1), run(batch, 0.3, num_splits=4)
    torch.testing.assert_close(one, many, atol=1e-5, rtol=0)


@pytest.mark.interpreted
def test_rows_outside_the_batch_untouched():
    """out may be larger than needed in no dimension, but only q's rows are written: poison stays out."""
    batch = make_batch([(3, 2)], 2, 1, 16, 4, torch.float32, seed=5)
    out = run(batch, 0.5)
    assert not out.isnan().any()


@pytest.mark.interpreted
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"].double()), "dtype"),
        (lambda a: a.update(key_cache=a["key_cache"].half()), "must agree"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be 1-D int32"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]), "query_start_loc"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(block_tables=a["block_tables"].t()), "block_tables"),
    ],
)
def test_bad_arguments_name_the_problem(change, message):
    batch = make_batch([(3, 2)], 4, 2, 16, 4, torch.float32, seed=1)
    seq_lens, starts = batch.device_meta()
    args = dict(
        q=batch.q,
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        block_tables=batch.block_tables,
        seq_lens=seq_lens,
        query_start_loc=starts,
        max_query_len=2,
        scale=0.5,
    )
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_attention_triton(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 37])
def test_cuda_serving_shapes(dtype, window):
    """Llama-like heads (32 query, 8 KV, head_dim 128), compiled tiles (64-row prefill, split-K decode)."""
    seqs = [(150, 70), (0, 129), (300, 1), (17, 1), (64, 33)]
    batch = make_batch(seqs, 32, 8, 128, 16, dtype, seed=11)
    expected = reference_attention(batch, 128**-0.5, window)
    cuda = {k: getattr(batch, k).cuda() for k in ("q", "key_cache", "value_cache", "block_tables")}
    seq_lens, starts = (t.cuda() for t in batch.device_meta())
    out = torch.full_like(cuda["q"], float("nan"))
    paged_attention_triton(
        cuda["q"],
        cuda["key_cache"],
        cuda["value_cache"],
        cuda["block_tables"],
        seq_lens,
        starts,
        max(batch.query_lens),
        128**-0.5,
        window,
        out=out,
    )
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    decode = make_batch([(700, 1), (5, 1), (260, 1)], 32, 8, 128, 16, dtype, seed=12)
    d_lens, d_starts = (t.cuda() for t in decode.device_meta())
    d_out = paged_attention_triton(
        decode.q.cuda(),
        decode.key_cache.cuda(),
        decode.value_cache.cuda(),
        decode.block_tables.cuda(),
        d_lens,
        d_starts,
        1,
        128**-0.5,
        window,
        num_splits=8,
    )
    expected = reference_attention(decode, 128**-0.5, window)
    torch.testing.assert_close(d_out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
