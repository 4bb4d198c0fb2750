"""`add_lora_paged`: adapters of mixed ranks in pages of rank rows, against the float64 reference.

Interpreted on the CPU in float32 (the interpreter's bf16 tl.dot is wrong); test_lora_paged_gpu.py runs
the compiled kernels in bf16. Rows past each rank and pages nobody owns hold NaN, and page-table entries
past a slot's pages point far outside the pool: a kernel that read any of them would fail here.
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
MIXED = [4, 8, 16, 64, 8, 16]  # one batch, ranks from 4 to 64


def run_paged(case, out_slices, path, backend="triton", meta=None, rank_buckets=None):
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
        rank_buckets=rank_buckets,
        meta=meta,
        path=path,
        backend=backend,
    )
    return y


def assert_matches(case, y) -> None:
    tol = TOLERANCES[y.dtype]
    torch.testing.assert_close(y.double(), case.expected(), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched]), "rows without an adapter must stay bitwise"


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("out_slices", [[96, 32, 32], [80]], ids=["qkv", "one_slice"])
def test_mixed_ranks_in_one_batch_match_the_float64_reference(out_slices, page, path) -> None:
    case = make_paged_case(
        seed_of("paged", out_slices, page, path), 23, 128, out_slices, MIXED, page, torch.float32
    )
    assert_matches(case, run_paged(case, out_slices, path))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_odd_sizes_and_many_tiles(path) -> None:
    ranks = [5, 16, 64, 1]
    case = make_paged_case(seed_of("odd", path), 70, 200, [72, 24], ranks, 8, torch.float32)
    meta = LoRABatchMeta.build(case.token_slots, len(ranks)) if path == "segmented" else None
    assert_matches(case, run_paged(case, [72, 24], path, meta=meta))


@pytest.mark.parametrize("path", PATHS)
def test_paged_equals_the_dense_slot_layout(path) -> None:
    """The same adapters as dense max-rank stacks (the old layout) give the same y."""
    out_slices = [64, 32]
    case = make_paged_case(seed_of("dense", path), 17, 96, out_slices, [16, 16, 16, 4], 8, torch.float32)
    dense = case.y.clone()
    lora_kernels.add_lora_multi(
        dense,
        case.x,
        case.dense_as,
        case.dense_bs,
        case.token_slots,
        case.scales,
        out_slices,
        slot_ranks=case.slot_ranks,
        path=path,
        backend="triton",
    )
    torch.testing.assert_close(run_paged(case, out_slices, path), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_rank_buckets_split_a_mixed_batch_and_match_the_reference(path) -> None:
    """Ranks 4-16 in a launch pair sized for rank 16, rank 64 in one sized for 64: the same y, to the
    float64 reference (pages past each bucket's width hold poisoned ids: never followed)."""
    out_slices = [96, 32, 32]
    case = make_paged_case(seed_of("buckets", path), 29, 128, out_slices, MIXED, 8, torch.float32)
    assert_matches(case, run_paged(case, out_slices, path, rank_buckets=(16, 64)))
    # Three buckets, one of them empty in this batch (no rank in (16, 32]).
    assert_matches(case, run_paged(case, out_slices, path, rank_buckets=(8, 16, 32, 64)))


@pytest.mark.parametrize("path", PATHS)
def test_one_small_bucket_serves_a_batch_of_small_ranks(path) -> None:
    """The step's largest rank is 16 in a pool for rank 64: kernels sized for 16, a page table two pages
    wide; the rank-64 slot exists but no token uses it."""
    ranks = [4, 16, 64, 8]
    case = make_paged_case(seed_of("small", path), 31, 96, [48], ranks, 8, torch.float32)
    case.token_slots[case.token_slots == 2] = -1
    assert_matches(case, run_paged(case, [48], path, rank_buckets=(16,)))


def test_rank_buckets_are_checked() -> None:
    case = make_paged_case(seed_of("bucket-checks"), 8, 64, [32], [8, 64], 8, torch.float32)
    for buckets, message in (
        ((12, 64), "multiples of the page"),
        ((64, 16), "ascending"),
        ((16, 128), "above the page table"),
        ((), "ascending positive"),
    ):
        with pytest.raises(ValueError, match=message):
            run_paged(case, [32], "gathered", rank_buckets=buckets)
    with pytest.raises(ValueError, match="above the largest rank bucket 16"):
        run_paged(case, [32], "gathered", rank_buckets=(16,))  # a token of the rank-64 slot


def test_the_torch_reference_path_matches_too() -> None:
    case = make_paged_case(seed_of("torch"), 9, 64, [48], MIXED, 8, torch.float32)
    assert_matches(case, run_paged(case, [48], "gathered", backend="torch"))


def test_bad_page_tables_are_refused() -> None:
    case = make_paged_case(seed_of("bad"), 4, 64, [32], [8, 16], 8, torch.float32)
    case.page_table[1, 1] = case.pool_as[0].shape[0]  # the second page of a rank-16 slot: past the pool
    with pytest.raises(ValueError, match="page_table row 1 points outside"):
        run_paged(case, [32], "gathered")
    with pytest.raises(ValueError, match="page_table must be an int32"):
        lora_kernels.add_lora_paged(
            case.y.clone(),
            case.x,
            case.pool_as,
            case.pool_bs,
            case.page_table.long(),
            case.token_slots,
            case.scales,
            [32],
            case.slot_ranks,
        )
    with pytest.raises(ValueError, match="same number of pages"):
        lora_kernels.add_lora_paged(
            case.y.clone(),
            case.x,
            case.pool_as,
            [case.pool_bs[0][:-1]],
            case.page_table,
            case.token_slots,
            case.scales,
            [32],
            case.slot_ranks,
        )
    with pytest.raises(ValueError, match="pool_b must be"):
        lora_kernels.add_lora_paged(
            case.y.clone(),
            case.x,
            case.pool_as,
            [case.pool_bs[0].transpose(1, 2)],
            case.page_table,
            case.token_slots,
            case.scales,
            [32],
            case.slot_ranks,
        )
