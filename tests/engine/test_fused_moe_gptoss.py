"""The fused-MoE kernels with gpt-oss's experts: biases on gate/up and down, and the clamped SwiGLU
((up + 1) * gate * sigmoid(alpha * gate), gate clamped above, up both sides), Triton (interpreted) and
torch paths against a float64 reference, with LoRA deltas, another rank's experts and poisoned buffers."""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import inputs

from engine.model import moe_kernels

LIMIT, ALPHA = 1.5, 1.702  # a limit the random pre-activations cross, so both clamps bite


def reference(x, w13, b13, w2, b2, weights, ids, num_local, delta13, delta2):
    x, w13, w2, b13, b2 = x.double(), w13.double(), w2.double(), b13.double(), b2.double()
    num_tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, top_k, w2.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e >= num_local:
                continue
            pre = w13[e] @ x[t] + b13[e] + delta13[t * top_k + k].double()
            gate, up = pre[:inter].clamp(max=LIMIT), pre[inter:].clamp(-LIMIT, LIMIT)
            h = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[t, k] = weights[t, k].double() * (w2[e] @ h + b2[e] + delta2[t * top_k + k].double())
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", [(7, 48, 40, 5, 3), (20, 64, 130, 3, 2)])
def test_biases_and_clamped_swiglu_match_float64(backend, case, monkeypatch):
    if backend == "triton" and not moe_kernels.interpreting():
        pytest.skip("Triton on CPU tensors: needs TRITON_INTERPRET=1")
    tokens, hidden, inter, experts, top_k = case
    x, w13, w2, weights, ids = inputs(*case, seed=5, foreign=True)
    gen = torch.Generator().manual_seed(11)
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    delta13 = torch.randn(tokens * top_k, 2 * inter, generator=gen)
    delta2 = torch.randn(tokens * top_k, hidden, generator=gen)
    empty = torch.empty
    monkeypatch.setattr(moe_kernels.torch, "empty", lambda *s, **k: empty(*s, **k).fill_(float("nan")))
    flat, act = ids.reshape(-1), dict(limit=LIMIT, alpha=ALPHA)
    if backend == "triton":
        rows, block_expert = moe_kernels.align_by_expert(
            flat, experts, moe_kernels.block_rows(flat.numel(), experts)
        )
        h = moe_kernels.gate_up_act(x, w13, rows, block_expert, top_k, delta13, b13, **act)
        out = moe_kernels.down_weighted(h, w2, weights.reshape(-1), rows, block_expert, delta2, b2)
    else:
        h = moe_kernels.gate_up_act_torch(x, w13, flat, top_k, delta13, b13, **act)
        out = moe_kernels.down_weighted_torch(h, w2, weights.reshape(-1), flat, delta2, b2)
    got = out.view(tokens, top_k, hidden).double()
    assert torch.isfinite(got).all()
    expected = reference(x, w13, b13, w2, b2, weights, ids, experts, delta13, delta2)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
