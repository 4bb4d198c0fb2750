"""Random own-LM-head problems (lora_kernels/own_heads.py) and their float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_SLOTS, NUM_HEADS = 7, 4
# pool slot -> head: slots 0, 2 and 3 own heads 2, 0 and 3 (head 1 is owned by no slot here: never read);
# slots 1, 4, 5, 6 are plain adapters (slot ids beyond the heads)
SLOT_HEADS = [2, -1, 0, 3, -1, -1, -1]


@dataclass
class OwnHeadCase:
    base: torch.Tensor  # [rows, vocab] the base head's logits
    hidden: torch.Tensor  # [rows, hidden]
    heads: torch.Tensor  # [NUM_HEADS, vocab, hidden]
    row_slots: torch.Tensor  # [rows] int32
    slot_heads: torch.Tensor  # [NUM_SLOTS] int32
    owned: torch.Tensor  # [rows] bool: rows whose slot owns a head

    def poisoned(self) -> torch.Tensor:
        """The base logits with NaN on the rows the kernel must write."""
        logits = self.base.clone()
        logits[self.owned] = float("nan")
        return logits

    def expected(self) -> torch.Tensor:  # [rows, vocab] float64
        expected = self.base.double().clone()
        for row, slot in enumerate(self.row_slots.tolist()):
            if slot >= 0 and SLOT_HEADS[slot] >= 0:
                expected[row] = self.hidden[row].double() @ self.heads[SLOT_HEADS[slot]].double().T
        return expected


def make_case(
    seed: int, rows: int, vocab: int, hidden: int, dtype=torch.float32, device="cpu"
) -> OwnHeadCase:
    """Every kind of row: no slot, plain slots, each head, with repeats (more than 16 rows of one head,
    a kernel tile, when rows > 16)."""
    gen = torch.Generator().manual_seed(seed)
    row_slots = torch.randint(-1, NUM_SLOTS, (rows,), generator=gen, dtype=torch.int32)
    if rows > 16:
        row_slots[:18] = 2
    owned = torch.tensor([s >= 0 and SLOT_HEADS[s] >= 0 for s in row_slots.tolist()], dtype=torch.bool)
    case = OwnHeadCase(
        base=torch.randn(rows, vocab, generator=gen).to(dtype),
        hidden=torch.randn(rows, hidden, generator=gen).to(dtype),
        heads=(torch.randn(NUM_HEADS, vocab, hidden, generator=gen) / hidden**0.5).to(dtype),
        row_slots=row_slots,
        slot_heads=torch.tensor(SLOT_HEADS, dtype=torch.int32),
        owned=owned,
    )
    for name in ("base", "hidden", "heads", "row_slots", "slot_heads", "owned"):
        setattr(case, name, getattr(case, name).to(device))
    return case
