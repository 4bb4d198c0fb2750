"""DoRA's epilogue in the expand kernels: `(y + update) * g[slot]` for DoRA slots, against float64.

g's rows of slots without DoRA (and of no slot at all) hold NaN: a kernel that read one would fail here,
as would one that scaled a plain LoRA slot's or a base-model token's row.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import TOLERANCES, seed_of
from paged_cases import make_paged_case

import lora_kernels
from lora_kernels import LoRABatchMeta

pytestmark = pytest.mark.interpreted
PATHS = ["gathered", "segmented"]
RANKS = [4, 8, 16, 64, 8, 16]
DORA = [1, 0, 1, 0, 1, 0]  # every other slot


def dora_tables(gen: torch.Generator, ranks, flags, num_columns: int):
    scales = torch.full((len(ranks), num_columns), float("nan"))
    for slot, flag in enumerate(flags):
        if flag:  # magnitudes over norms near 1, as trained adapters have them
            scales[slot] = 0.5 + torch.rand(num_columns, generator=gen)
    return scales, torch.tensor(flags, dtype=torch.int32)


def expected(case, g, flags) -> torch.Tensor:
    y = case.expected()
    for t, slot in enumerate(case.token_slots.tolist()):
        if slot >= 0 and flags[slot]:
            y[t] = y[t] * g[slot].double()
    return y


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_slices", [[96, 32, 32], [80]], ids=["qkv", "one_slice"])
def test_dora_slots_scale_their_rows_and_nothing_else(out_slices, path, backend) -> None:
    seed = seed_of("dora", out_slices, path, backend)
    case = make_paged_case(seed, 29, 128, out_slices, RANKS, 8, torch.float32)
    g, flags = dora_tables(torch.Generator().manual_seed(seed), RANKS, DORA, sum(out_slices))
    meta = LoRABatchMeta.build(case.token_slots, len(RANKS)) if path == "segmented" else None
    # A strided view, as the pool hands the kernels one projection's columns of a wider table.
    wide = torch.full((len(RANKS), sum(out_slices) + 24), float("nan"))
    wide[:, 8 : 8 + sum(out_slices)] = g
    y = case.y.clone()
    lora_kernels.add_lora_paged(
        y,
        case.x,
        case.pool_as,
        case.pool_bs,
        case.page_table,
        case.token_slots,
        case.scales,
        out_slices,
        case.slot_ranks,
        dora_scales=wide[:, 8 : 8 + sum(out_slices)],
        dora_slots=flags,
        meta=meta,
        path=path,
        backend=backend,
    )
    tol = TOLERANCES[y.dtype]
    torch.testing.assert_close(y.double(), expected(case, g, DORA), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched]), "rows without an adapter must stay bitwise"
    assert (case.token_slots[:, None] == torch.tensor(DORA).nonzero().T).any(1).any(), "no DoRA token"


def test_dora_arguments_are_checked() -> None:
    case = make_paged_case(seed_of("dora_bad"), 4, 64, [32], [8, 16], 8, torch.float32)
    args = (case.x, case.pool_as, case.pool_bs, case.page_table, case.token_slots, case.scales, [32])
    g, flags = torch.ones(2, 32), torch.ones(2, dtype=torch.int32)
    for kwargs, match in [
        (dict(dora_scales=g), "go together"),
        (dict(dora_scales=g.double(), dora_slots=flags), "dora_scales must be float32"),
        (dict(dora_scales=torch.ones(2, 31), dora_slots=flags), r"\[2, 32\]"),
        (dict(dora_scales=g, dora_slots=flags.long()), "dora_slots must be int32"),
    ]:
        with pytest.raises(ValueError, match=match):
            lora_kernels.add_lora_paged(case.y.clone(), *args, case.slot_ranks, **kwargs)
