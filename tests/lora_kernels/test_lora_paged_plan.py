"""`plan_paged` once, `run_paged` for every layer (what the engine's LoRAContext does in a step): each
layer's call, with its own pools, x and y of the planned shapes and the step's token slots, matches the
float64 reference, and equals `add_lora_paged` called afresh, bitwise. Interpreted on the CPU in float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lora_cases import seed_of
from paged_cases import make_paged_case
from test_lora_paged import assert_matches, run_paged

from lora_kernels import LoRABatchMeta, ops

pytestmark = pytest.mark.interpreted
RANKS = [4, 16, 8, 16]
OUT = [48, 16, 16]


@pytest.mark.parametrize(
    ("path", "buckets"),
    [("gathered", None), ("segmented", (8, 16))],
    ids=["gathered", "segmented_two_buckets"],
)
def test_one_plan_serves_every_layer(path, buckets) -> None:
    first = make_paged_case(seed_of("plan", path, 0), 21, 64, OUT, RANKS, 8, torch.float32)
    layers = [first] + [
        dataclasses.replace(
            make_paged_case(seed_of("plan", path, i), 21, 64, OUT, RANKS, 8, torch.float32),
            token_slots=first.token_slots,  # one step: the same tokens in every layer
        )
        for i in (1,)
    ]
    meta = LoRABatchMeta.build(first.token_slots, len(RANKS)) if path == "segmented" else None
    plan = ops.plan_paged(
        first.y, first.x, first.pool_as, first.pool_bs, first.page_table, first.token_slots, first.scales,
        OUT, first.slot_ranks, rank_buckets=buckets, meta=meta, path=path, backend="triton",
    )  # fmt: skip
    for case in layers:
        y = case.y.clone()
        ops.run_paged(
            plan, y, case.x, case.pool_as, case.pool_bs, case.page_table, case.scales, case.slot_ranks
        )
        assert_matches(case, y)
        assert torch.equal(y, run_paged(case, OUT, path, meta=meta, rank_buckets=buckets))
