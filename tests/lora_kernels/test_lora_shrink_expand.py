"""`shrink` and `expand` as ops of their own, against the float64 reference, under TRITON_INTERPRET."""

from __future__ import annotations

import pytest
import torch
from lora_cases import TOLERANCES, make_case, seed_of

import lora_kernels
from lora_kernels import reference

PATHS = ["gathered", "segmented"]


@pytest.mark.parametrize("mixed_ranks", [False, True], ids=["max_rank", "mixed_ranks"])
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_shrink_overwrites_every_row_of_h(
    path: str, dtype: torch.dtype, num_slices: int, mixed_ranks: bool
) -> None:
    case = make_case(
        seed_of(path, dtype, num_slices, mixed_ranks),
        9,
        1031,
        [16] * num_slices,
        4,
        16,
        dtype,
        mixed_ranks=mixed_ranks,
    )
    h = torch.full((num_slices, 9, 16), float("nan"))
    lora_kernels.shrink(
        h, case.x, case.lora_as, case.token_slots, slot_ranks=case.slot_ranks, path=path, backend="triton"
    )
    expected = reference.shrink(
        case.x.double(), [a.double() for a in case.lora_as], case.token_slots, case.slot_ranks
    )
    assert torch.isfinite(h).all()
    torch.testing.assert_close(h.double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(h[:, case.token_slots < 0], torch.zeros_like(h[:, case.token_slots < 0]))


def test_shrink_accepts_one_tensor_and_a_2d_h() -> None:
    case = make_case(seed_of("2d"), 6, 64, [8], 3, 8, torch.float32)
    h = torch.full((6, 8), float("nan"))
    lora_kernels.shrink(h, case.x, case.lora_as[0], case.token_slots, backend="triton")
    torch.testing.assert_close(h, reference.shrink(case.x, case.lora_as, case.token_slots)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_expand_matches_reference(path: str, dtype: torch.dtype) -> None:
    out_slices = [200, 56]
    case = make_case(seed_of("expand", path, dtype), 13, 32, out_slices, 5, 16, dtype)
    h = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(seed_of("h", path, dtype)))
    y = case.y.clone()
    lora_kernels.expand(y, h, case.lora_bs, case.token_slots, case.scales, path=path, backend="triton")
    expected = reference.expand(
        case.y.double(),
        h.double(),
        [b.double() for b in case.lora_bs],
        case.token_slots,
        [s.double() for s in case.scales],
    )
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    assert torch.equal(y[case.token_slots < 0], case.y[case.token_slots < 0])


@pytest.mark.parametrize("path", PATHS)
def test_shrink_then_expand_equals_add_lora(path: str) -> None:
    case = make_case(seed_of("compose", path), 10, 96, [48], 4, 16, torch.float32)
    h = torch.full((10, 16), float("nan"))
    lora_kernels.shrink(h, case.x, case.lora_as[0], case.token_slots, path=path, backend="triton")
    y_two_ops, y_fused = case.y.clone(), case.y.clone()
    lora_kernels.expand(
        y_two_ops, h, case.lora_bs[0], case.token_slots, case.scales[0], path=path, backend="triton"
    )
    lora_kernels.add_lora(
        y_fused,
        case.x,
        case.lora_as[0],
        case.lora_bs[0],
        case.token_slots,
        case.scales[0],
        path=path,
        backend="triton",
    )
    torch.testing.assert_close(y_two_ops, y_fused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_expand_reads_no_rank_past_max_rank(path: str) -> None:
    """max_rank 12 is rounded up to 16 for vector loads; nothing past a row's 12 ranks may be read."""
    case = make_case(seed_of("rank12", path), 5, 32, [40], 3, 12, torch.float32, mixed_ranks=True)
    buffer = torch.full((5 * 12 + 16,), float("nan"))  # h followed by NaN: a stray read poisons y
    h = buffer[: 5 * 12].view(1, 5, 12)
    h.copy_(torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(seed_of("h12", path))))
    y = case.y.clone()
    lora_kernels.expand(
        y,
        h,
        case.lora_bs,
        case.token_slots,
        case.scales,
        slot_ranks=case.slot_ranks,
        path=path,
        backend="triton",
    )
    expected = reference.expand(
        case.y.double(),
        h.double(),
        [b.double() for b in case.lora_bs],
        case.token_slots,
        [s.double() for s in case.scales],
        case.slot_ranks,
    )
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-4)
