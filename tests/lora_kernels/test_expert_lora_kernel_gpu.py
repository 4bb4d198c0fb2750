"""The expert-LoRA kernel (lora_kernels/expert_kernels.py) compiled on a GPU (skipped without CUDA):
float32 and bfloat16 against float64 at the MoE benchmark's sizes (Qwen3-30B-A3B: hidden 2048, expert
intermediate 768, 128 experts, top-8, batch 128 over 16 rank-8 adapters, so 1024 pairs per projection),
in a larger-rank pool and at a prefill's size (pairs grouped by (slot, expert)), and inside a CUDA graph
whose tokens change slots and experts between replays.

    TRITON_INTERPRET=0 python -m pytest tests/lora_kernels/test_expert_lora_kernel_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch
from expert_lora_cases import make_case

from lora_kernels.expert_kernels import ORDER_MIN_PAIRS, expert_lora_delta, pair_order

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # bf16: delta's one rounding
BENCH = dict(num_tokens=128, num_experts=128, top_k=8, slot_ranks=[8] * 16)
CASES = {
    # name: (in, out, per_pair_input, extra)
    "gate_up": (2048, 1536, False, {}),
    "down": (768, 2048, True, {}),
    "mixed_ranks": (2048, 1536, False, dict(slot_ranks=[64, 8, 0, 17, 3, 32], max_rank=64)),
    "prefill_down": (768, 2048, True, dict(num_tokens=1024)),  # 8192 pairs: grouped by (slot, expert)
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_expert_lora_matches_float64_on_the_gpu(name, dtype):
    in_features, out_features, per_pair, extra = CASES[name]
    kwargs = {**BENCH, **extra}
    problem = make_case(
        kwargs.pop("num_tokens"), in_features, out_features, kwargs.pop("num_experts"), kwargs.pop("top_k"),
        kwargs.pop("slot_ranks"), seed=len(name) + out_features, per_pair_input=per_pair, **kwargs,
    )  # fmt: skip
    gpu = problem.to("cuda", dtype)
    order = pair_order(gpu.token_slots, gpu.local_ids, gpu.top_k, gpu.num_local)
    assert (order is not None) == (gpu.local_ids.numel() >= ORDER_MIN_PAIRS)
    got = expert_lora_delta(*gpu.args(), order=order)
    expected = gpu.to("cpu", torch.float64).expected()  # from the same (rounded) inputs
    scale = expected.abs().max()
    error = (got.double().cpu() - expected).abs().max() / scale
    assert torch.isfinite(got).all() and error <= TOLERANCE[dtype], error


def test_expert_lora_in_a_cuda_graph_follows_slots_and_experts():
    problem = make_case(16, 256, 192, 8, 2, [8, 16, 5], seed=3).to("cuda", torch.float32)
    args = list(problem.args())
    token_slots, local_ids = problem.token_slots.clone(), problem.local_ids.clone()
    args[4], args[5] = token_slots, local_ids
    expert_lora_delta(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_lora_delta(*args)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        token_slots.copy_(torch.randint(-1, 3, token_slots.shape, generator=gen))
        local_ids.copy_(torch.stack([torch.randperm(9, generator=gen)[:2] for _ in range(16)]).reshape(-1))
        graph.replay()
        problem.token_slots, problem.local_ids = token_slots, local_ids
        expected = problem.to("cpu", torch.float64).expected()
        torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)
