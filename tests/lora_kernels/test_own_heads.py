"""The own-LM-head kernel (lora_kernels/own_heads.py) against a float64 reference: rows of several heads, of
no slot, of plain slots (no head) and of heads no row uses; rows without a head keep the logits they had
(poisoned with NaN where the kernel must write, so a row it skipped fails)."""

from __future__ import annotations

import pytest
import torch
from lora_cases import seed_of

from lora_kernels.own_heads import own_head_logits

pytestmark = pytest.mark.interpreted
NUM_SLOTS, NUM_HEADS = 7, 4
# pool slot -> head: slots 0, 2 and 3 own heads 2, 0 and 3 (head 1 is owned by no slot here: never read);
# slots 1, 4, 5, 6 are plain adapters (slot ids beyond the heads)
SLOT_HEADS = [2, -1, 0, 3, -1, -1, -1]


def reference(logits, hidden, heads, row_slots) -> torch.Tensor:
    expected = logits.double().clone()
    for row, slot in enumerate(row_slots.tolist()):
        if slot >= 0 and SLOT_HEADS[slot] >= 0:
            expected[row] = hidden[row].double() @ heads[SLOT_HEADS[slot]].double().T
    return expected


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "rows, vocab, hidden", [(1, 100, 48), (37, 130, 64), (20, 64, 200)], ids=["one", "mixed", "wide"]
)
def test_own_heads_match_float64_and_leave_other_rows(rows, vocab, hidden, backend) -> None:
    gen = torch.Generator().manual_seed(seed_of("own_heads", rows, vocab, hidden, backend))
    hidden_states = torch.randn(rows, hidden, generator=gen)
    heads = torch.randn(NUM_HEADS, vocab, hidden, generator=gen) / hidden**0.5
    # every kind of row: no slot, plain slots, each head, with repeats (more than BLOCK_M rows of one head
    # in the "mixed" case)
    row_slots = torch.randint(-1, NUM_SLOTS, (rows,), generator=gen, dtype=torch.int32)
    if rows > 16:
        row_slots[:18] = 2
    base = torch.randn(rows, vocab, generator=gen)
    slot_heads = torch.tensor(SLOT_HEADS, dtype=torch.int32)
    owned = torch.tensor([s >= 0 and SLOT_HEADS[s] >= 0 for s in row_slots.tolist()])
    logits = base.clone()
    logits[owned] = float("nan")  # the kernel must write every one of these rows
    out = own_head_logits(logits, hidden_states, heads, row_slots, slot_heads, backend=backend)
    assert out is logits
    expected = reference(base, hidden_states, heads, row_slots)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[~owned], base[~owned])  # untouched, bit for bit


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
