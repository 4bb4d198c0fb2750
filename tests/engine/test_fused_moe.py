"""The fused-MoE kernels (engine/model/moe_kernels.py) against a float64 reference on fresh random
inputs: the Triton path (interpreted here, fp32) and the torch path, with odd expert counts and top-k,
pairs of experts another rank holds (expert parallelism: skipped, their rows zero), LoRA deltas added
before the activation and before the routing weight, and outputs poisoned with NaN first, so a row a
kernel forgets to write fails the test."""

from __future__ import annotations

import pytest
import torch

from engine.model import moe_kernels

CASES = [
    # tokens, hidden, intermediate, experts, top_k
    (1, 64, 32, 8, 2),
    (7, 48, 40, 5, 3),  # odd expert count and top-k, sizes off the 64-wide tiles
    (33, 96, 72, 7, 1),
    (20, 64, 130, 3, 3),  # every expert of 3 per token; intermediate past two tiles
]


def reference(x, w13, w2, weights, ids, num_local, delta13=None, delta2=None):
    """float64, token by token: [T, K, H] weighted per-pair outputs (zero for another rank's expert)."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    num_tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, top_k, w2.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if e >= num_local:
                continue
            pre = w13[e] @ x[t]
            if delta13 is not None:
                pre = pre + delta13[t * top_k + k].double()
            h = torch.nn.functional.silu(pre[:inter]) * pre[inter:]
            y = w2[e] @ h
            if delta2 is not None:
                y = y + delta2[t * top_k + k].double()
            out[t, k] = weights[t, k] * y
    return out


def inputs(tokens, hidden, inter, experts, top_k, seed, foreign=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack(
        [torch.randperm(experts + (1 if foreign else 0), generator=gen)[:top_k] for _ in range(tokens)]
    )
    return x, w13, w2, weights, ids


def test_align_by_expert_blocks_hold_one_expert_each():
    ids = torch.tensor([2, 0, 2, 5, 1, 2, 0, 5])  # 5 = another rank's expert (num_experts 5)
    rows, block_expert = moe_kernels.align_by_expert(ids, num_experts=5, block_m=2)
    num_pairs = ids.numel()
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        block = rows[b * 2 : (b + 1) * 2].tolist()
        if e < 0:
            assert all(p == num_pairs for p in block)
            continue
        real = [p for p in block if p < num_pairs]
        assert all(int(ids[p]) == e for p in real)
        seen += real
    assert sorted(seen) == [i for i in range(num_pairs) if ids[i] < 5]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("foreign", [False, True])
@pytest.mark.parametrize("with_delta", [False, True])
def test_fused_moe_matches_float64(backend, case, foreign, with_delta, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        if not moe_kernels.interpreting():
            pytest.skip("Triton on CPU tensors: needs TRITON_INTERPRET=1")
    tokens, hidden, inter, experts, top_k = case
    x, w13, w2, weights, ids = inputs(*case, seed=hash((case, foreign)) % 1000, foreign=foreign)
    flat = ids.reshape(-1)
    gen = torch.Generator().manual_seed(7)
    delta13 = torch.randn(tokens * top_k, 2 * inter, generator=gen) if with_delta else None
    delta2 = torch.randn(tokens * top_k, hidden, generator=gen) if with_delta else None
    poisoned_empty = torch.empty

    def poisoned(*shape, **kwargs):  # every buffer the kernels allocate starts as NaN
        return poisoned_empty(*shape, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(moe_kernels.torch, "empty", poisoned)
    if backend == "triton":
        block_m = moe_kernels.block_rows(flat.numel(), experts)
        rows, block_expert = moe_kernels.align_by_expert(flat, experts, block_m)
        h = moe_kernels.gate_up_act(x, w13, rows, block_expert, top_k, delta13)
        out = moe_kernels.down_weighted(h, w2, weights.reshape(-1), rows, block_expert, delta2)
    else:
        h = moe_kernels.gate_up_act_torch(x, w13, flat, top_k, delta13)
        out = moe_kernels.down_weighted_torch(h, w2, weights.reshape(-1), flat, delta2)
    expected = reference(x, w13, w2, weights, ids, experts, delta13, delta2)
    got = out.view(tokens, top_k, hidden).double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
