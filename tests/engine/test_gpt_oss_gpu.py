"""gpt-oss's kernels compiled on a GPU (skipped without CUDA): paged attention with sinks (64-row prefill
tiles, split-K decode, gpt-oss's 64-wide heads, 8 query heads per KV head) and the fused-MoE kernels with
biases and the clamped SwiGLU, fp32 and bf16, against float64. The model itself (float32 = transformers +
PEFT with CUDA graphs; bf16 top-5 agreement) runs in test_moe_gpu.py's families.

    TRITON_INTERPRET=0 python -m pytest tests/engine/test_gpt_oss_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import make_batch, reference_attention
from test_fused_moe import inputs
from test_fused_moe_gptoss import ALPHA, LIMIT
from test_fused_moe_gptoss import reference as moe_reference

from engine.model import moe_kernels
from engine.model.paged_attention_triton import paged_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 128])
def test_attention_with_sinks_compiled(dtype, window):
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    sinks = torch.linspace(-2.0, 4.0, 16, dtype=torch.float32)
    for seqs, splits in (([(0, 200), (21, 90), (300, 17)], None), ([(590, 1), (8, 1), (130, 1)], 4)):
        batch = make_batch(seqs, 16, 2, 64, 16, dtype, seed=len(seqs) + (splits or 0))
        expected = reference_attention(batch, 64**-0.5, window, sinks=sinks)
        seq_lens, starts = (t.cuda() for t in batch.device_meta())
        out = torch.full_like(batch.q.cuda(), float("nan"))
        paged_attention_triton(
            batch.q.cuda(), batch.key_cache.cuda(), batch.value_cache.cuda(), batch.block_tables.cuda(),
            seq_lens, starts, max(batch.query_lens), 64**-0.5, window, num_splits=splits, out=out,
            sinks=sinks.cuda(),
        )  # fmt: skip
        torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("case", [(1, 2880, 2880, 32, 4), (200, 2880, 2880, 32, 4), (37, 512, 200, 7, 3)])
def test_fused_moe_with_biases_compiled(dtype, tol, case, monkeypatch):
    tokens, hidden, inter, experts, top_k = case
    x, w13, w2, weights, ids = inputs(*case, seed=2)
    gen = torch.Generator().manual_seed(3)
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    zeros13, zeros2 = torch.zeros(tokens * top_k, 2 * inter), torch.zeros(tokens * top_k, hidden)
    expected = moe_reference(x, w13, b13, w2, b2, weights, ids, experts, zeros13, zeros2)
    x, w13, w2, b13, b2 = (t.to("cuda", dtype) for t in (x, w13, w2, b13, b2))
    flat = ids.reshape(-1).cuda()
    empty = torch.empty  # the kernels' buffers poisoned: every row they use must be written
    monkeypatch.setattr(moe_kernels.torch, "empty", lambda *s, **k: empty(*s, **k).fill_(float("nan")))
    rows, block_expert = moe_kernels.align_by_expert(
        flat, experts, moe_kernels.block_rows(flat.numel(), experts)
    )
    h = moe_kernels.gate_up_act(x, w13, rows, block_expert, top_k, None, b13, limit=LIMIT, alpha=ALPHA)
    out = moe_kernels.down_weighted(h, w2, weights.reshape(-1).cuda(), rows, block_expert, None, b2)
    got = out.view(tokens, top_k, hidden).double().cpu()
    assert torch.isfinite(got).all()
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= tol * scale, (got - expected).abs().max() / scale
