"""fp8 KV cache, kernel level: e4m3 quantization, write_kv, and both attention backends (Triton interpreted
on the CPU) reading float8 caches, against a float64 reference computed on the dequantized K/V."""

from __future__ import annotations

import zlib

import pytest
import torch
from paged_attention_cases import make_batch, quantize_batch, reference_attention

from engine.model.attention import AttentionMetadata, paged_attention, write_kv
from engine.model.kv_quant import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from engine.model.paged_attention_triton import paged_attention_triton

# (k_scale, v_scale): vLLM's default, calibrated-like (amax / 448 of N(0, 1) data), and coarse scales that
# push small entries into e4m3's subnormals.
SCALES = {"unit": (1.0, 1.0), "calibrated": (0.01, 0.02), "coarse": (3.0, 0.5)}
CASES = {
    # name: (seqs as (cached, new), num_heads, num_kv_heads, head_dim, block_size, window, splits)
    "decode_split_k": ([(37, 1), (3, 1), (0, 1)], 4, 2, 16, 4, None, 3),
    "chunked_prefill_gqa": ([(9, 6), (0, 1), (20, 4)], 6, 2, 16, 8, None, None),
    "prefill_window_odd_head": ([(13, 5), (0, 11)], 3, 3, 24, 4, 6, None),
}
# N(0, 1) K/V quantized to e4m3 move this attention's outputs by about 0.014 on average, 0.12 at most;
# a K scale off by 2x moves them by about 1.
QUANTIZATION_MAX_ERROR, QUANTIZATION_MEAN_ERROR = 0.25, 0.03


def case_batch(name: str, dtype=torch.float32):
    seqs, heads, kv_heads, head_dim, block_size, window, splits = CASES[name]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed=zlib.crc32(name.encode()))
    return batch, head_dim**-0.5, window, splits


def metadata(batch) -> AttentionMetadata:
    positions = [p for s, q in zip(batch.seq_lens, batch.query_lens) for p in range(s - q, s)]
    return AttentionMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.zeros(len(positions), dtype=torch.long),
        block_tables=batch.block_tables,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
    )


@pytest.mark.parametrize("scale", [1.0, 0.01, 3.0])
def test_round_trip_error_is_e4m3_rounding(scale):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 50 * scale  # |x / scale| up to ~200
    scale_t = torch.tensor([scale])
    stored = quantize_fp8(x, scale_t)
    assert stored.dtype == FP8_DTYPE
    back = dequantize_fp8(stored, scale_t, torch.float32)
    normal = (x / scale).abs() >= 2**-6  # e4m3's smallest normal; 3 mantissa bits: relative error <= 2^-4
    assert ((back - x).abs() <= 2**-4 * x.abs())[normal].all()
    assert ((back - x).abs() <= 2**-10 * scale)[~normal].all()  # half the subnormal step 2^-9
    # Every finite e4m3 value times the scale comes back exactly.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()] * scale
    assert torch.equal(dequantize_fp8(quantize_fp8(grid, scale_t), scale_t, torch.float32), grid)


def test_out_of_range_saturates_instead_of_nan():
    scale = torch.tensor([0.5])
    stored = quantize_fp8(torch.tensor([1e6, -1e6, 449 * 0.5, float("inf")]), scale)
    assert stored.float().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, FP8_MAX]


def test_write_kv_stores_quantized_values_at_their_slots():
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.zeros(3, 4, 2, 8, dtype=FP8_DTYPE)  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache = torch.zeros_like(key_cache)
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([0, 5, 6, 11, 2])
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.5])
    write_kv(key_cache, value_cache, k, v, slots, k_scale, v_scale)
    flat_k, flat_v = key_cache.view(-1, 2, 8), value_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[slots].view(torch.uint8), quantize_fp8(k, k_scale).view(torch.uint8))
    assert torch.equal(flat_v[slots].view(torch.uint8), quantize_fp8(v, v_scale).view(torch.uint8))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].float().any() and not flat_v[untouched].float().any()
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        write_kv(key_cache, value_cache, k, v, slots)


@pytest.mark.parametrize("scales", sorted(SCALES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_path_reads_fp8(name, scales):
    batch, scale, window, _ = case_batch(name)
    fp8, dequantized, k_scale, v_scale = quantize_batch(batch, *SCALES[scales])
    out = paged_attention(
        fp8.q, fp8.key_cache, fp8.value_cache, metadata(fp8), scale, window, k_scale, v_scale
    )
    torch.testing.assert_close(
        out.double(), reference_attention(dequantized, scale, window), atol=1e-5, rtol=0
    )
    error = (out.double() - reference_attention(batch, scale, window)).abs()
    assert error.max() < QUANTIZATION_MAX_ERROR and error.mean() < QUANTIZATION_MEAN_ERROR


@pytest.mark.interpreted
@pytest.mark.parametrize("scales", sorted(SCALES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_reads_fp8_like_the_torch_path(name, scales):
    batch, scale, window, splits = case_batch(name)
    fp8, dequantized, k_scale, v_scale = quantize_batch(batch, *SCALES[scales])
    seq_lens, starts = fp8.device_meta()
    out = torch.full_like(fp8.q, float("nan"))
    paged_attention_triton(
        fp8.q,
        fp8.key_cache,
        fp8.value_cache,
        fp8.block_tables,
        seq_lens,
        starts,
        max(fp8.query_lens),
        scale,
        window,
        num_splits=splits,
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    torch.testing.assert_close(
        out.double(), reference_attention(dequantized, scale, window), atol=1e-4, rtol=0
    )
    torch_path = paged_attention(
        fp8.q, fp8.key_cache, fp8.value_cache, metadata(fp8), scale, window, k_scale, v_scale
    )
    torch.testing.assert_close(out, torch_path, atol=1e-4, rtol=0)


@pytest.mark.interpreted
def test_triton_fp8_with_half_precision_queries():
    batch, scale, window, splits = case_batch("chunked_prefill_gqa", torch.float16)
    fp8, dequantized, k_scale, v_scale = quantize_batch(batch, 0.01, 0.02)
    seq_lens, starts = fp8.device_meta()
    out = paged_attention_triton(
        fp8.q,
        fp8.key_cache,
        fp8.value_cache,
        fp8.block_tables,
        seq_lens,
        starts,
        max(fp8.query_lens),
        scale,
        window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out.double(), reference_attention(dequantized, scale, window), atol=2e-3, rtol=2e-3
    )


@pytest.mark.parametrize("drop", ["k_scale", "v_scale"])
def test_fp8_caches_need_both_scales(drop):
    batch, scale, window, _ = case_batch("decode_split_k")
    fp8, _, k_scale, v_scale = quantize_batch(batch, 1.0, 1.0)
    scales = {"k_scale": k_scale, "v_scale": v_scale, drop: None}
    seq_lens, starts = fp8.device_meta()
    with pytest.raises(ValueError, match=drop):
        paged_attention_triton(
            fp8.q, fp8.key_cache, fp8.value_cache, fp8.block_tables, seq_lens, starts, 1, scale, **scales
        )
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention(fp8.q, fp8.key_cache, fp8.value_cache, metadata(fp8), scale, None, **scales)
    with pytest.raises(ValueError, match="must agree"):  # one fp8 cache and one in the model dtype
        paged_attention_triton(
            fp8.q,
            fp8.key_cache,
            batch.value_cache,
            fp8.block_tables,
            seq_lens,
            starts,
            1,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_fp8_serving_shapes(dtype):
    """Compiled kernels at Llama-like heads (32 query, 8 KV, head_dim 128): prefill tiles and split-K decode
    over float8 caches, against the reference on the dequantized K/V."""
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for seqs, splits in (
        ([(150, 70), (0, 129), (300, 1), (17, 1), (64, 33)], None),
        ([(700, 1), (5, 1), (260, 1)], 8),
    ):
        batch = make_batch(seqs, 32, 8, 128, 16, dtype, seed=13)
        fp8, dequantized, k_scale, v_scale = quantize_batch(batch, 0.01, 0.02)
        seq_lens, starts = (t.cuda() for t in fp8.device_meta())
        out = paged_attention_triton(
            fp8.q.cuda(),
            fp8.key_cache.cuda(),
            fp8.value_cache.cuda(),
            fp8.block_tables.cuda(),
            seq_lens,
            starts,
            max(fp8.query_lens),
            128**-0.5,
            num_splits=splits,
            k_scale=k_scale.cuda(),
            v_scale=v_scale.cuda(),
        )
        expected = reference_attention(dequantized, 128**-0.5, None)
        torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)
