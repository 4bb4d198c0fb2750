"""The host wrappers reject bad arguments with a ValueError that names the problem."""

from __future__ import annotations

import pytest
import torch
from lora_cases import make_case, seed_of

import lora_kernels
from lora_kernels import LoRABatchMeta


@pytest.fixture
def case():
    return make_case(seed_of("errors"), 6, 64, [32], 3, 8, torch.float32)


def call(case, backend: str = "triton", **changes):
    args = dict(
        y=case.y.clone(),
        x=case.x,
        lora_a=case.lora_as[0],
        lora_b=case.lora_bs[0],
        token_slots=case.token_slots,
        scales=case.scales[0],
    )
    kwargs = {k: changes.pop(k) for k in ("slot_ranks", "meta", "path", "validate") if k in changes}
    args.update(changes)
    return lora_kernels.add_lora(**args, backend=backend, **kwargs)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (lambda c: dict(token_slots=c.token_slots.long()), "int32"),
        (lambda c: dict(token_slots=c.token_slots[:-1]), "6 entries"),
        (lambda c: dict(lora_a=c.lora_as[0].double()), "dtype"),
        (lambda c: dict(y=c.y.half()), "dtype"),
        (lambda c: dict(x=c.x.to(torch.int32)), "supported"),
        (lambda c: dict(x=c.x.T.contiguous().T), "contiguous"),
        (lambda c: dict(y=c.y.T.contiguous().T), "unit column stride"),
        (lambda c: dict(lora_b=c.lora_bs[0][:, :31]), "lora_b must be"),
        (lambda c: dict(lora_a=c.lora_as[0][:, :, :63].contiguous()), "lora_a must be"),
        (lambda c: dict(lora_b=c.lora_bs[0].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda c: dict(x=c.x[:5]), "rows"),
        (lambda c: dict(scales=c.scales[0].double()), "scales"),
        (lambda c: dict(scales=c.scales[0][:2]), "scales"),
        (lambda c: dict(scales=c.scales[0].repeat(2)[::2]), "contiguous float32"),
        (
            lambda c: dict(lora_a=c.lora_as[0].reshape(-1)[: 8 * 64 + 2].as_strided((3, 8, 64), (1, 64, 1))),
            "contiguous within each slot",
        ),
        (
            lambda c: dict(slot_ranks=torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)[::2]),
            "contiguous int32",
        ),
        (lambda c: dict(slot_ranks=torch.tensor([1, 2], dtype=torch.int32)), "slot_ranks"),
        (lambda c: dict(path="bgmv"), "path"),
    ],
)
def test_bad_arguments_raise(case, changes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(case, **changes(case))


@pytest.mark.parametrize("bad_slot", [3, -2])
def test_slot_values_are_checked_on_the_cpu(case, bad_slot: int) -> None:
    slots = case.token_slots.clone()
    slots[2] = bad_slot
    with pytest.raises(ValueError, match=rf"holds {bad_slot}.*\[-1, 3\)"):
        call(case, backend="torch", token_slots=slots)
    with pytest.raises(ValueError, match="holds"):
        call(case, token_slots=slots, validate=True)


def test_slot_ranks_past_max_rank_are_rejected(case) -> None:
    with pytest.raises(ValueError, match="slot_ranks must be in"):
        call(case, slot_ranks=torch.tensor([8, 9, 1], dtype=torch.int32))


def test_too_many_slices(case) -> None:
    with pytest.raises(ValueError, match="between 1 and 3 slices"):
        lora_kernels.add_lora_multi(
            case.y.repeat(1, 4),
            case.x,
            case.lora_as * 4,
            case.lora_bs * 4,
            case.token_slots,
            case.scales * 4,
            [32] * 4,
            backend="triton",
        )


def test_stale_meta_is_rejected(case) -> None:
    meta = LoRABatchMeta.build(case.token_slots[:4], num_slots=3)
    with pytest.raises(ValueError, match="meta.update"):
        call(case, meta=meta, path="segmented")


def test_triton_on_cpu_needs_the_interpreter(case, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        call(case)


def test_h_shape_is_checked(case) -> None:
    with pytest.raises(ValueError, match="h must be"):
        lora_kernels.shrink(torch.empty(6, 4), case.x, case.lora_as[0], case.token_slots, backend="triton")
    with pytest.raises(ValueError, match="h must be"):
        lora_kernels.expand(
            case.y.clone(),
            torch.empty(6, 8, dtype=torch.float64),
            case.lora_bs[0],
            case.token_slots,
            case.scales[0],
            backend="triton",
        )
