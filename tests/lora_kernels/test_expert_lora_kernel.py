"""The expert-LoRA kernel (lora_kernels/expert_kernels.py), interpreted on the CPU in float32, against a
float64 reference on fresh random pools: several slots of several ranks (pages in shuffled order, ranks
below the page size), untargeted slots (rank 0), base-model tokens, pairs of another rank's experts
(their inputs NaN, as the fused-MoE kernel leaves them), with the output poisoned with NaN first."""

from __future__ import annotations

import pytest
import torch
from expert_lora_cases import make_case

from lora_kernels import expert_kernels

pytestmark = pytest.mark.interpreted

CASES = [
    # tokens, in, out, experts, top_k, slot ranks
    (5, 48, 40, 4, 2, [8, 3, 16]),  # rank 3 below the page size; slot 2 two pages
    (9, 33, 70, 5, 3, [5, 0, 20, 1]),  # odd sizes off the tiles; slot 1 untargeted; three pages
    (3, 64, 16, 3, 3, [8]),  # every expert of 3 per token
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_pair_input", [False, True])
def test_expert_lora_matches_float64(case, per_pair_input, monkeypatch):
    tokens, in_features, out_features, experts, top_k, ranks = case
    problem = make_case(*case, seed=tokens * 31 + in_features + per_pair_input, per_pair_input=per_pair_input)
    real_empty = torch.empty

    def poisoned(*shape, **kwargs):  # the output buffer starts as NaN: every row must be written
        return real_empty(*shape, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(expert_kernels.torch, "empty", poisoned)
    got = expert_kernels.expert_lora_delta(*problem.args())
    expected = problem.expected()
    assert got.shape == expected.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    inactive = (problem.local_ids >= experts) | (problem.token_slots.repeat_interleave(top_k) < 0)
    assert inactive.any() and (got[inactive] == 0).all()


def test_rank_smaller_than_the_pools():
    """A pool sized for rank 32 (four pages per slot) holding adapters of rank 2 and 9."""
    problem = make_case(4, 40, 24, 3, 2, [2, 9], seed=5, max_rank=32)
    got = expert_kernels.expert_lora_delta(*problem.args())
    torch.testing.assert_close(got.double(), problem.expected(), rtol=1e-5, atol=1e-5)


def test_mismatched_inputs_are_refused():
    problem = make_case(4, 40, 24, 3, 2, [8], seed=6)
    args = list(problem.args())
    args[0] = problem.x[:, :-1]
    with pytest.raises(ValueError, match="input features"):
        expert_kernels.expert_lora_delta(*args)


def test_pair_order_groups_pairs_by_slot_and_expert(monkeypatch):
    """Programs taking the pairs in any order (prefill's: grouped by (slot, expert)) write the same rows."""
    problem = make_case(12, 40, 24, 4, 2, [8, 5, 16], seed=8, per_pair_input=True)
    assert expert_kernels.pair_order(problem.token_slots, problem.local_ids, 2, 4) is None  # below the size
    monkeypatch.setattr(expert_kernels, "ORDER_MIN_PAIRS", 1)
    order = expert_kernels.pair_order(problem.token_slots, problem.local_ids, 2, 4)
    slots = problem.token_slots.long().repeat_interleave(2)[order]
    ids = problem.local_ids[order]
    active = (slots >= 0) & (ids < 4)
    assert sorted(order.tolist()) == list(range(24))
    num_active = int(active.sum())
    assert 0 < num_active < 24 and active[:num_active].all()  # inactive pairs last
    keys = (slots * 4 + ids)[active]
    assert (keys[1:] >= keys[:-1]).all()
    expected = problem.expected()
    shuffled = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    for pairs in (order, shuffled):
        got = expert_kernels.expert_lora_delta(*problem.args(), order=pairs)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
