"""Attention logit soft-capping (Gemma 2): scores become cap * tanh(scores / cap) before the mask, in the
Triton kernel (interpreted on the CPU) and on the torch path, against a float64 reference; with sliding
windows, split-K decode, GQA and an fp8 cache; and the transformers reference keeps the cap."""

from __future__ import annotations

import pytest
import torch
from factories import load_peft_reference, make_model
from paged_attention_cases import make_batch, quantize_batch, reference_attention
from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.paged_attention_triton import paged_attention_triton

CASES = {
    # name: (seqs as (cached, new), heads, kv heads, head_dim, block_size, window, splits)
    "prefill_window": ([(0, 11), (6, 5)], 4, 2, 16, 4, 6, None),
    "decode_split_k": ([(37, 1), (3, 1)], 4, 2, 16, 8, None, 3),
    "chunked_gqa": ([(9, 6), (0, 1), (20, 4)], 6, 2, 16, 8, None, None),
}
CAP = 2.0  # small against these scores (up to ~6), so the cap changes the result


def metadata(batch) -> AttentionMetadata:
    positions = [p for s, q in zip(batch.seq_lens, batch.query_lens) for p in range(s - q, s)]
    return AttentionMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.zeros(len(positions), dtype=torch.long),
        block_tables=batch.block_tables,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
    )


def batch_for(name: str):
    seqs, heads, kv_heads, head_dim, block_size, window, splits = CASES[name]
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, torch.float32, seed=len(name))
    batch.q.mul_(3.0)  # larger scores: the cap must bite
    return batch, head_dim**-0.5, window, splits


def triton(batch, scale, window, splits, **kwargs):
    seq_lens, starts = batch.device_meta()
    return paged_attention_triton(
        batch.q,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        seq_lens,
        starts,
        max(batch.query_lens),
        scale,
        window,
        num_splits=splits,
        softcap=CAP,
        **kwargs,
    )


@pytest.mark.interpreted
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_caps_scores(name):
    batch, scale, window, splits = batch_for(name)
    out = triton(batch, scale, window, splits)
    expected = reference_attention(batch, scale, window, softcap=CAP)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=0)
    uncapped = reference_attention(batch, scale, window)
    assert (uncapped - expected).abs().max() > 0.05, "the cap should change this case's output"


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_path_caps_scores(name):
    batch, scale, window, _ = batch_for(name)
    out = paged_attention(
        batch.q, batch.key_cache, batch.value_cache, metadata(batch), scale, window, softcap=CAP
    )
    torch.testing.assert_close(
        out.double(), reference_attention(batch, scale, window, softcap=CAP), atol=1e-5, rtol=0
    )


@pytest.mark.interpreted
def test_fp8_cache_with_a_cap():
    batch, scale, window, splits = batch_for("chunked_gqa")
    fp8, dequantized, k_scale, v_scale = quantize_batch(batch, 0.05, 0.02)
    out = triton(fp8, scale, window, splits, k_scale=k_scale, v_scale=v_scale)
    expected = reference_attention(dequantized, scale, window, softcap=CAP)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=0)


def test_a_cap_must_be_positive():
    batch, scale, window, splits = batch_for("decode_split_k")
    seq_lens, starts = batch.device_meta()
    with pytest.raises(ValueError, match="softcap must be positive"):
        paged_attention_triton(
            batch.q,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            seq_lens,
            starts,
            1,
            scale,
            softcap=0.0,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8])
def test_cuda_compiled_tiles_cap_scores(dtype, window):
    """The compiled kernel (64-row prefill tiles, split-K decode), not the interpreter: Gemma 2's heads."""
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for seqs, splits in (([(0, 60), (21, 40), (3, 17)], None), ([(59, 1), (8, 1), (130, 1)], 4)):
        batch = make_batch(seqs, 4, 2, 16, 16, dtype, seed=len(seqs) + (splits or 0))
        batch.q.mul_(3.0)  # larger scores: the cap must bite
        expected = reference_attention(batch, 24**-0.5, window, softcap=10.0 / 4)
        seq_lens, starts = (t.cuda() for t in batch.device_meta())
        out = torch.full_like(batch.q.cuda(), float("nan"))
        paged_attention_triton(
            batch.q.cuda(),
            batch.key_cache.cuda(),
            batch.value_cache.cuda(),
            batch.block_tables.cuda(),
            seq_lens,
            starts,
            max(batch.query_lens),
            24**-0.5,
            window,
            num_splits=splits,
            out=out,
            softcap=10.0 / 4,
        )
        torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def test_transformers_reference_keeps_the_soft_cap_where_it_would_default_to_sdpa(tmp_path, monkeypatch):
    """transformers 5.17 (the GPU machines') defaults Gemma 2 to SDPA, whose path drops the attention soft
    cap without a word: test_models_gpu's reference then disagreed with the engine (on the GPU and on the
    CPU alike) on 18 of its 24 prompts. The reference names eager attention for soft-capped models."""
    model_dir = make_model(tmp_path / "model", arch="gemma2", seed=1)
    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", True)  # as transformers 5.17 ships it
    reference = load_peft_reference(model_dir, {})
    assert reference.config._attn_implementation == "eager"
    input_ids = torch.arange(3, 23)[None]  # 20 tokens, past the 8-token window
    with torch.inference_mode():
        capped = reference(input_ids).logits
        for layer in reference.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = reference(input_ids).logits
    assert not torch.allclose(capped, uncapped, atol=1e-3)  # the cap bites at this size
