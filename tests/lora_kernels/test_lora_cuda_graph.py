"""On a GPU: no host sync on the Triton path, and CUDA-graph replay equals eager execution."""

from __future__ import annotations

import pytest
import torch
from lora_cases import assert_lora_result, make_case, seed_of

import lora_kernels
from lora_kernels import LoRABatchMeta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def cuda_case(seed: int, num_tokens: int):
    return make_case(seed, num_tokens, 512, [384, 128], 8, 16, torch.bfloat16, device="cuda")


def run(case, y, meta, path):
    return lora_kernels.add_lora_multi(
        y, case.x, case.lora_as, case.lora_bs, case.token_slots, case.scales, [384, 128], meta=meta, path=path
    )


@pytest.mark.parametrize("path", ["gathered", "segmented"])
def test_no_host_sync_and_graph_replay_matches_eager(path: str) -> None:
    case = cuda_case(seed_of("graph", path), 64)
    meta = LoRABatchMeta.allocate(64, 8, "cuda")
    meta.update(case.token_slots)
    run(case, case.y.clone(), meta, path)  # compile outside the checks

    torch.cuda.set_sync_debug_mode("error")
    try:
        meta.update(case.token_slots)
        y_eager = run(case, case.y.clone(), meta, path)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_lora_result(case, case.y, y_eager)

    static_y = case.y.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(case, static_y.clone(), meta, path)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case, static_y, meta, path)

    fresh = cuda_case(seed_of("graph", path, "next step"), 64)  # new activations and slots, same buffers
    case.x.copy_(fresh.x)
    case.token_slots.copy_(fresh.token_slots)
    static_y.copy_(fresh.y)
    meta.update(case.token_slots)
    graph.replay()
    y_eager = run(case, fresh.y.clone(), meta, path)
    torch.cuda.synchronize()
    assert torch.equal(static_y, y_eager)
