"""LoRABatchMeta bookkeeping: the docstring's worked example and tables of batch shapes."""

from __future__ import annotations

import pytest
import torch

from lora_kernels import NO_LORA, LoRABatchMeta
from lora_kernels.meta import choose_block_m, max_num_tiles


def tiles_of(meta: LoRABatchMeta) -> list[tuple[int, int, int]]:
    """(slot, start, len) of the used tiles."""
    n = meta.num_tiles
    rows = zip(meta.tile_slot[:n].tolist(), meta.tile_start[:n].tolist(), meta.tile_len[:n].tolist())
    return [row for row in rows if row[2] > 0]


def test_worked_example() -> None:
    meta = LoRABatchMeta.build(torch.tensor([-1, 0, 2, 1, 0], dtype=torch.int32), num_slots=3)
    assert meta.sorted_tokens[:5].tolist() == [1, 4, 3, 2, 0]
    assert meta.tokens_per_slot.tolist() == [2, 1, 1, 1]
    assert meta.slot_starts.tolist() == [0, 2, 3, 4]
    assert (meta.block_m, meta.num_tiles) == (16, 5)
    assert tiles_of(meta) == [(0, 0, 2), (1, 2, 1), (2, 3, 1), (NO_LORA, 4, 1)]
    assert meta.tile_len[:5].tolist()[4] == 0
    assert meta.any_lora.tolist() == [True]


@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "block_m"),
    [(1, 1, 16), (64, 64, 16), (256, 64, 16), (100, 4, 32), (4096, 16, 64), (8192, 1, 64)],
)
def test_block_m_follows_tokens_per_slot(num_tokens: int, num_slots: int, block_m: int) -> None:
    assert choose_block_m(num_tokens, num_slots) == block_m


@pytest.mark.parametrize("seed", range(6))
def test_tiles_cover_every_token_once_within_the_bound(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_slots = int(torch.randint(1, 9, (1,), generator=gen))
    num_tokens = int(torch.randint(1, 200, (1,), generator=gen))
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    meta = LoRABatchMeta.build(slots, num_slots)
    assert meta.num_tiles == max_num_tiles(num_tokens, num_slots, meta.block_m)
    covered = []
    for slot, start, length in tiles_of(meta):
        assert 0 < length <= meta.block_m
        tokens = meta.sorted_tokens[start : start + length]
        assert (slots[tokens] == slot).all()
        covered += tokens.tolist()
    assert sorted(covered) == list(range(num_tokens))


def test_update_reuses_the_buffers() -> None:
    meta = LoRABatchMeta.allocate(max_tokens=8, num_slots=2, device="cpu")
    buffers = [meta.sorted_tokens.data_ptr(), meta.tile_len.data_ptr()]
    meta.update(torch.tensor([1, 1, 0], dtype=torch.int32))
    assert tiles_of(meta) == [(0, 0, 1), (1, 1, 2)]
    meta.update(torch.full((8,), NO_LORA, dtype=torch.int32))
    assert tiles_of(meta) == [(NO_LORA, 0, 8)]
    assert meta.any_lora.tolist() == [False]
    assert [meta.sorted_tokens.data_ptr(), meta.tile_len.data_ptr()] == buffers
    with pytest.raises(ValueError, match="max_tokens=8"):
        meta.update(torch.zeros(9, dtype=torch.int32))
