"""The compiled paged kernels on a GPU (skipped elsewhere), in bf16 and fp16 against float64, mixed ranks
4 to 64 in one batch, and a CUDA-graph replay equal to eager execution.

    TRITON_INTERPRET=0 python -m pytest tests/lora_kernels/test_lora_paged_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import TOLERANCES, seed_of
from paged_cases import make_paged_case

import lora_kernels
from lora_kernels import LoRABatchMeta, tiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(tiles.interpreting(), reason="compiled kernels: run with TRITON_INTERPRET=0"),
]
MIXED = [4, 8, 16, 64] * 4


def run(case, out_slices, path, y=None, meta=None, rank_buckets=None):
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
        rank_buckets=rank_buckets,
        meta=meta,
        path=path,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", ["gathered", "segmented"])
@pytest.mark.parametrize(
    "num_tokens, in_features, out_slices",
    [(64, 2048, [2048, 512, 512]), (300, 4096, [1024]), (7, 2049, [1531, 24])],
    ids=["decode_qkv", "prefill", "odd"],
)
def test_mixed_ranks_match_float64(num_tokens, in_features, out_slices, path, dtype) -> None:
    for page in (8, 16):
        case = make_paged_case(
            seed_of("gpu", num_tokens, path, dtype, page),
            num_tokens,
            in_features,
            out_slices,
            MIXED,
            page,
            dtype,
            device="cuda",
        )
        y = run(case, out_slices, path)
        tol = TOLERANCES[dtype]
        torch.testing.assert_close(y.double(), case.expected(), rtol=tol, atol=tol)
        untouched = case.token_slots < 0
        assert torch.equal(y[untouched], case.y[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", ["gathered", "segmented"])
def test_rank_buckets_match_float64(path, dtype) -> None:
    """Ranks 4-16 and 64 in launch pairs sized for 16 and 64 (the engine's mixed-rank steps)."""
    out_slices = [2048, 512, 512]
    num_tokens = 64 if path == "gathered" else 300
    case = make_paged_case(
        seed_of("gpu-buckets", path, dtype), num_tokens, 2048, out_slices, MIXED, 8, dtype, "cuda"
    )
    y = run(case, out_slices, path, rank_buckets=(16, 64))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), case.expected(), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])


@pytest.mark.parametrize("path", ["gathered", "segmented"])
def test_graph_replay_matches_eager_without_host_syncs(path) -> None:
    out_slices = [512, 128]
    case = make_paged_case(seed_of("graph", path), 64, 512, out_slices, MIXED, 8, torch.bfloat16, "cuda")
    meta = LoRABatchMeta.allocate(64, len(MIXED), "cuda")
    meta.update(case.token_slots)
    run(case, out_slices, path, meta=meta)  # compile outside the checks
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = run(case, out_slices, path, meta=meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_y = case.y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case, out_slices, path, y=static_y, meta=meta)
    static_y.copy_(case.y)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, eager)
