"""The DoRA epilogue of the compiled expand kernels on a GPU (skipped elsewhere): bf16 and fp16 against
float64, a quarter to all of the slots DoRA, and a CUDA-graph replay equal to eager execution.

    TRITON_INTERPRET=0 python -m pytest tests/lora_kernels/test_lora_dora_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import TOLERANCES, seed_of
from paged_cases import make_paged_case
from test_lora_dora import dora_tables, expected

import lora_kernels
from lora_kernels import LoRABatchMeta, tiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(tiles.interpreting(), reason="compiled kernels: run with TRITON_INTERPRET=0"),
]
RANKS = [4, 8, 16, 64] * 4
FLAGS = {"quarter": [1, 0, 0, 0] * 4, "all": [1] * 16}


def run(case, out_slices, path, g, flags, y=None, meta=None):
    y = case.y.clone() if y is None else y
    return lora_kernels.add_lora_paged(
        y,
        case.x,
        case.pool_as,
        case.pool_bs,
        case.page_table,
        case.token_slots,
        case.scales,
        out_slices,
        case.slot_ranks,
        dora_scales=g,
        dora_slots=flags,
        meta=meta,
        path=path,
    )


@pytest.mark.parametrize("dora", sorted(FLAGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", ["gathered", "segmented"])
@pytest.mark.parametrize(
    "num_tokens, in_features, out_slices",
    [(64, 2048, [2048, 512, 512]), (300, 4096, [1024]), (7, 2049, [1531, 24])],
    ids=["decode_qkv", "prefill", "odd"],
)
def test_dora_matches_float64(num_tokens, in_features, out_slices, path, dtype, dora) -> None:
    seed = seed_of("dora-gpu", num_tokens, path, dtype, dora)
    case = make_paged_case(seed, num_tokens, in_features, out_slices, RANKS, 8, dtype, device="cuda")
    g, flags = dora_tables(torch.Generator().manual_seed(seed), RANKS, FLAGS[dora], sum(out_slices))
    y = run(case, out_slices, path, g.cuda(), flags.cuda())
    tol = TOLERANCES[dtype]
    want = expected(case, g.cuda(), FLAGS[dora])
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])


@pytest.mark.parametrize("path", ["gathered", "segmented"])
def test_graph_replay_matches_eager_without_host_syncs(path) -> None:
    out_slices = [512, 128]
    case = make_paged_case(seed_of("dora-graph", path), 64, 512, out_slices, RANKS, 8, torch.bfloat16, "cuda")
    g, flags = dora_tables(torch.Generator().manual_seed(7), RANKS, FLAGS["quarter"], sum(out_slices))
    g, flags = g.cuda(), flags.cuda()
    meta = LoRABatchMeta.allocate(64, len(RANKS), "cuda")
    meta.update(case.token_slots)
    run(case, out_slices, path, g, flags, meta=meta)  # compile outside the checks
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = run(case, out_slices, path, g, flags, meta=meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_y = case.y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case, out_slices, path, g, flags, y=static_y, meta=meta)
    static_y.copy_(case.y)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, eager)
