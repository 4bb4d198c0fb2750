"""Attention sinks (gpt-oss): each head's learned logit joins the softmax's denominator with no value, in
the Triton kernel (interpreted on the CPU: prefill, chunked prefill, split-K decode, sliding window, GQA,
fp8 cache) and on the torch path, against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import make_batch, quantize_batch, reference_attention
from test_soft_capped_attention import metadata

from engine.model.attention import paged_attention
from engine.model.paged_attention_triton import paged_attention_triton

CASES = {
    # name: (seqs as (cached, new), heads, kv heads, head_dim, block_size, window, splits)
    "prefill_window": ([(0, 11), (6, 5)], 4, 2, 16, 4, 6, None),
    "decode_split_k": ([(37, 1), (3, 1)], 4, 2, 16, 8, None, 3),
    "decode_window_split_k": ([(37, 1), (5, 1)], 4, 2, 16, 8, 12, 3),  # split 0 starts at the window
    "chunked_gqa": ([(9, 6), (0, 1), (20, 4)], 6, 2, 16, 8, None, None),
}


def batch_for(name: str):
    seqs, heads, kv_heads, head_dim, block_size, window, splits = CASES[name]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, torch.float32, seed=len(name))
    # Sinks around the scores' size, some large: they take a visible share of every row.
    sinks = torch.linspace(-1.0, 3.0, heads, dtype=torch.float32)
    return batch, head_dim**-0.5, window, splits, sinks


def triton(batch, scale, window, splits, sinks, **kwargs):
    seq_lens, starts = batch.device_meta()
    out = torch.full_like(batch.q, float("nan"))  # poisoned: every row must be written
    return paged_attention_triton(
        batch.q, batch.key_cache, batch.value_cache, batch.block_tables, seq_lens, starts,
        max(batch.query_lens), scale, window, num_splits=splits, out=out, sinks=sinks, **kwargs,
    )  # fmt: skip


@pytest.mark.interpreted
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_with_sinks(name):
    batch, scale, window, splits, sinks = batch_for(name)
    expected = reference_attention(batch, scale, window, sinks=sinks)
    torch.testing.assert_close(
        triton(batch, scale, window, splits, sinks).double(), expected, atol=1e-5, rtol=0
    )
    assert (reference_attention(batch, scale, window) - expected).abs().max() > 0.05, "sinks must matter"


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_path_with_sinks(name):
    batch, scale, window, _, sinks = batch_for(name)
    out = paged_attention(
        batch.q, batch.key_cache, batch.value_cache, metadata(batch), scale, window, sinks=sinks
    )
    torch.testing.assert_close(
        out.double(), reference_attention(batch, scale, window, sinks=sinks), atol=1e-5, rtol=0
    )


@pytest.mark.interpreted
def test_fp8_cache_with_sinks():
    batch, scale, window, splits, sinks = batch_for("decode_split_k")
    fp8, dequantized, k_scale, v_scale = quantize_batch(batch, 0.05, 0.02)
    out = triton(fp8, scale, window, splits, sinks, k_scale=k_scale, v_scale=v_scale)
    expected = reference_attention(dequantized, scale, window, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=0)


def test_sinks_must_match_the_heads():
    batch, scale, window, splits, sinks = batch_for("decode_split_k")
    with pytest.raises(ValueError, match="sinks must be float32"):
        triton(batch, scale, window, splits, sinks[:-1])
