"""The fused Triton ops (`add_lora`, `add_lora_multi`) against the float64 reference, under TRITON_INTERPRET."""

from __future__ import annotations

import pytest
import torch
from lora_cases import assert_lora_result, make_case, seed_of

import lora_kernels
from lora_kernels import LoRABatchMeta, tiles

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PATHS = ["gathered", "segmented"]

# (num_tokens, in, out, num_slots, max_rank, token pattern)
SHAPES = {
    "odd_sizes": (5, 2049, 1531, 3, 7, "mixed"),
    "rank_1_one_slot": (6, 64, 48, 1, 1, "mixed"),
    "rank_64_distinct_64_slots": (9, 128, 96, 64, 64, "distinct"),
    "one_adapter": (20, 256, 160, 4, 16, "one"),
    "multi_tile_mixed": (70, 64, 40, 3, 16, "mixed"),
    "no_lora_rows_only": (4, 96, 80, 2, 16, "none"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
def test_add_lora_matches_reference(shape: str, path: str, dtype: torch.dtype) -> None:
    num_tokens, in_features, out, num_slots, max_rank, pattern = SHAPES[shape]
    case = make_case(
        seed_of(shape, path, dtype), num_tokens, in_features, [out], num_slots, max_rank, dtype, pattern
    )
    y = case.y.clone()
    lora_kernels.add_lora(
        y,
        case.x,
        case.lora_as[0],
        case.lora_bs[0],
        case.token_slots,
        case.scales[0],
        path=path,
        backend="triton",
    )
    assert_lora_result(case, case.y, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_slices", [[300, 130, 40], [72, 72]], ids=["qkv", "gate_up"])
def test_add_lora_multi_on_a_column_view(out_slices: list[int], path: str, dtype: torch.dtype) -> None:
    case = make_case(seed_of(out_slices, path, dtype), 11, 160, out_slices, 5, 16, dtype)
    wide = torch.randn(11, sum(out_slices) + 13).to(dtype)  # y is a column view with row stride > width
    wide[:, 6 : 6 + sum(out_slices)] = case.y
    before = wide.clone()
    y = wide[:, 6 : 6 + sum(out_slices)]
    lora_kernels.add_lora_multi(
        y,
        case.x,
        case.lora_as,
        case.lora_bs,
        case.token_slots,
        case.scales,
        out_slices,
        path=path,
        backend="triton",
    )
    assert_lora_result(case, case.y, y)
    assert torch.equal(wide[:, :6], before[:, :6]) and torch.equal(
        wide[:, 6 + sum(out_slices) :], before[:, 6 + sum(out_slices) :]
    )


@pytest.mark.parametrize("path", PATHS)
def test_mixed_ranks_skip_the_tail_with_identical_results(path: str) -> None:
    case = make_case(seed_of("ranks", path), 12, 192, [64, 32], 6, 64, torch.bfloat16, mixed_ranks=True)
    outs = []
    for slot_ranks in (case.slot_ranks, None):
        y = case.y.clone()
        lora_kernels.add_lora_multi(
            y,
            case.x,
            case.lora_as,
            case.lora_bs,
            case.token_slots,
            case.scales,
            [64, 32],
            slot_ranks=slot_ranks,
            path=path,
            backend="triton",
        )
        outs.append(y)
    assert_lora_result(case, case.y, outs[0])
    assert torch.equal(outs[0], outs[1])


def test_preallocated_meta_is_reused_across_batches() -> None:
    meta = LoRABatchMeta.allocate(max_tokens=48, num_slots=4, device="cpu")
    for step, num_tokens in enumerate([48, 17, 30]):
        case = make_case(seed_of("meta", step), num_tokens, 96, [64], 4, 8, torch.float32)
        meta.update(case.token_slots)
        y = case.y.clone()
        lora_kernels.add_lora(
            y,
            case.x,
            case.lora_as[0],
            case.lora_bs[0],
            case.token_slots,
            case.scales[0],
            meta=meta,
            path="segmented",
            backend="triton",
        )
        assert_lora_result(case, case.y, y)


def test_cpu_tensors_take_the_reference_path_by_default() -> None:
    case = make_case(seed_of("cpu"), 7, 64, [32], 3, 8, torch.float32)
    y, y_ref = case.y.clone(), case.y.clone()
    lora_kernels.add_lora(y, case.x, case.lora_as[0], case.lora_bs[0], case.token_slots, case.scales[0])
    lora_kernels.reference.add_lora(
        y_ref, case.x, case.lora_as[0], case.lora_bs[0], case.token_slots, case.scales[0]
    )
    assert torch.equal(y, y_ref)


def test_empty_batch_is_a_no_op() -> None:
    case = make_case(seed_of("empty"), 1, 64, [32], 3, 8, torch.float32)
    y = case.y[:0].clone()
    slots = case.token_slots[:0]
    for path in PATHS:
        lora_kernels.add_lora(
            y,
            case.x[:0],
            case.lora_as[0],
            case.lora_bs[0],
            slots,
            case.scales[0],
            path=path,
            backend="triton",
        )
    assert y.shape == (0, 32)


@pytest.mark.parametrize("path", PATHS)
def test_split_k_partials_are_summed(path: str, monkeypatch) -> None:
    monkeypatch.setattr(tiles, "num_sms", lambda device: 64)  # as on a GPU: many programs, so K is split
    case = make_case(seed_of("split", path), 6, 1000, [72], 3, 16, torch.bfloat16)
    rows = 6 if path == "gathered" else LoRABatchMeta.build(case.token_slots, 3).num_tiles
    config = tiles.shrink_config(path, rows, 1, 1000, 16, torch.bfloat16, case.x.device, 16)
    assert config.split_k > 1
    y = case.y.clone()
    lora_kernels.add_lora(
        y,
        case.x,
        case.lora_as[0],
        case.lora_bs[0],
        case.token_slots,
        case.scales[0],
        path=path,
        backend="triton",
    )
    assert_lora_result(case, case.y, y)


def pooled(stacks: list[torch.Tensor], gap: int) -> list[torch.Tensor]:
    """The same stacks as views into one slot-major pool (as engine/lora/slots.py lays adapters out): each
    slot's blocks of every slice side by side, `gap` elements of NaN between them and after each slot."""
    num_slots = stacks[0].shape[0]
    sizes = [t[0].numel() for t in stacks]
    pool = torch.full(
        (num_slots, sum(sizes) + gap * len(stacks)),
        float("nan"),
        dtype=stacks[0].dtype,
        device=stacks[0].device,
    )
    views, offset = [], 0
    for t, size in zip(stacks, sizes):
        view = pool[:, offset : offset + size].view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += size + gap
    return views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_slot_strided_weights_in_a_pool_match_reference(path: str, dtype: torch.dtype) -> None:
    """Compiled on a GPU run (the engine's layout), interpreted on the CPU."""
    out_slices = [96, 32, 32]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(
        seed_of("pool", path, dtype), 13, 128, out_slices, 4, 16, dtype, mixed_ranks=True, device=device
    )
    lora_as, lora_bs = pooled(case.lora_as, gap=64), pooled(case.lora_bs, gap=64)
    assert all(not t.is_contiguous() for t in lora_as + lora_bs)  # NaN gaps between slots, read by nothing
    y = case.y.clone()
    lora_kernels.add_lora_multi(
        y,
        case.x,
        lora_as,
        lora_bs,
        case.token_slots,
        case.scales,
        out_slices,
        slot_ranks=case.slot_ranks,
        path=path,
        backend="triton",
    )
    assert_lora_result(case, case.y, y)
