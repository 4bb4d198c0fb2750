"""The own-LM-head kernel (lora_kernels/own_heads.py) against a float64 reference: rows of several heads, of
no slot, of plain slots (no head) and of heads no row uses; rows without a head keep the logits they had
(poisoned with NaN where the kernel must write, so a row it skipped fails)."""

from __future__ import annotations

import pytest
import torch
from lora_cases import seed_of
from own_head_cases import NUM_HEADS, SLOT_HEADS, make_case

from lora_kernels.own_heads import own_head_logits

pytestmark = pytest.mark.interpreted


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "rows, vocab, hidden", [(1, 100, 48), (37, 130, 64), (20, 64, 200)], ids=["one", "mixed", "wide"]
)
def test_own_heads_match_float64_and_leave_other_rows(rows, vocab, hidden, backend) -> None:
    case = make_case(seed_of("own_heads", rows, vocab, hidden, backend), rows, vocab, hidden)
    logits = case.poisoned()
    out = own_head_logits(logits, case.hidden, case.heads, case.row_slots, case.slot_heads, backend=backend)
    assert out is logits
    torch.testing.assert_close(logits.double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[~case.owned], case.base[~case.owned])  # untouched, bit for bit


def test_no_row_with_a_head_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 32, generator=gen)
    before = logits.clone()
    own_head_logits(
        logits,
        torch.randn(5, 16, generator=gen),
        torch.full((NUM_HEADS, 32, 16), float("nan")),  # a head read would poison the logits
        torch.tensor([-1, 1, 4, -1, 6], dtype=torch.int32),
        torch.tensor(SLOT_HEADS, dtype=torch.int32),
    )
    assert torch.equal(logits, before)


def test_bad_arguments_are_refused() -> None:
    logits, hidden, heads = torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(1, 8, 4)
    slots = torch.tensor([0, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="row_slots must lie in"):
        own_head_logits(logits, hidden, heads, torch.tensor([0, 5], dtype=torch.int32), slots)
    with pytest.raises(ValueError, match="disagree"):
        own_head_logits(torch.zeros(2, 9), hidden, heads, slots, slots)
    with pytest.raises(ValueError, match="int32"):
        own_head_logits(logits, hidden, heads, slots.long(), slots)
