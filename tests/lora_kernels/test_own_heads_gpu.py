"""The own-LM-head kernel compiled on a GPU (skipped without CUDA): float32 and bfloat16 against float64,
and inside a CUDA graph whose rows change slots between replays (the decode graphs' use).

    TRITON_INTERPRET=0 python -m pytest tests/lora_kernels/test_own_heads_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import seed_of
from own_head_cases import NUM_SLOTS, make_case

from lora_kernels.own_heads import own_head_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "rows, vocab, hidden", [(1, 1000, 256), (37, 4100, 320), (256, 2048, 2048)], ids=["one", "mixed", "big"]
)
def test_own_heads_match_float64_on_the_gpu(rows, vocab, hidden, dtype) -> None:
    case = make_case(seed_of("own_heads_gpu", rows, vocab, hidden, dtype), rows, vocab, hidden, dtype, "cuda")
    logits = case.poisoned()
    own_head_logits(logits, case.hidden, case.heads, case.row_slots, case.slot_heads)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(logits.double(), case.expected(), rtol=tol, atol=tol)
    assert torch.equal(logits[~case.owned], case.base[~case.owned])


def test_own_heads_in_a_cuda_graph_follow_the_rows_slots() -> None:
    case = make_case(5, 16, 1000, 256, torch.float32, "cuda")
    logits, row_slots = case.base.clone(), case.row_slots.clone()
    own_head_logits(logits, case.hidden, case.heads, row_slots, case.slot_heads)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        own_head_logits(logits, case.hidden, case.heads, row_slots, case.slot_heads)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):  # new slots each replay, as a decode step's static buffers
        new = torch.randint(-1, NUM_SLOTS, (16,), generator=gen, dtype=torch.int32)
        row_slots.copy_(new)
        logits.copy_(case.base)
        graph.replay()
        case.row_slots = new.cuda()
        case.owned = torch.tensor([s >= 0 and case.slot_heads[s] >= 0 for s in new.tolist()]).cuda()
        torch.testing.assert_close(logits.double(), case.expected(), rtol=1e-4, atol=1e-4)
