"""Random grouped-LoRA problems and the float64 reference they are checked against."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from lora_kernels import reference

# Relative and absolute tolerances on y (values of order 1-10): one rounding of the output dominates.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def seed_of(*params: object) -> int:
    """A seed derived from the test's parameters, so every case draws its own inputs."""
    return zlib.crc32(repr(params).encode())


@dataclass
class Case:
    x: torch.Tensor  # [num_tokens, in]
    y: torch.Tensor  # [num_tokens, sum(out_slices)], random
    lora_as: list[torch.Tensor]  # num_slices x [num_slots, max_rank, in]
    lora_bs: list[torch.Tensor]  # num_slices x [num_slots, out_slice, max_rank]
    token_slots: torch.Tensor  # [num_tokens] int32
    scales: list[torch.Tensor]  # num_slices x [num_slots] float32
    slot_ranks: torch.Tensor | None  # [num_slots] int32; A and B zero past each slot's rank

    def expected(self) -> torch.Tensor:
        """y + the LoRA delta, in float64 from the same (rounded) inputs."""
        y = self.y.double().clone()
        return reference.add_lora_multi(
            y,
            self.x.double(),
            [a.double() for a in self.lora_as],
            [b.double() for b in self.lora_bs],
            self.token_slots,
            [s.double() for s in self.scales],
            [b.shape[1] for b in self.lora_bs],
            self.slot_ranks,
        )


def token_slots_for(pattern: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """mixed: random slots with -1 rows; one: every token the same adapter; distinct: every token its own;
    none: no token uses an adapter."""
    if pattern == "mixed":
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
        slots[0], slots[-1] = -1, num_slots - 1
    elif pattern == "one":
        slots = torch.full((num_tokens,), num_slots - 1)
    elif pattern == "distinct":
        slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    elif pattern == "none":
        slots = torch.full((num_tokens,), -1)
    else:
        raise ValueError(pattern)
    return slots.to(torch.int32)


def make_case(
    seed: int,
    num_tokens: int,
    in_features: int,
    out_slices: list[int],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    pattern: str = "mixed",
    mixed_ranks: bool = False,
    device: str = "cpu",
) -> Case:
    """Drawn on the CPU from `seed`, then moved to `device`."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    slot_ranks = None
    keep = torch.ones(num_slots, max_rank)
    if mixed_ranks:
        slot_ranks = torch.randint(1, max_rank + 1, (num_slots,), generator=gen, dtype=torch.int32)
        slot_ranks[0] = max_rank
        keep = (torch.arange(max_rank)[None, :] < slot_ranks[:, None]).float()  # [num_slots, max_rank]
    lora_as = [
        rand(num_slots, max_rank, in_features, std=in_features**-0.5) * keep[:, :, None].to(dtype)
        for _ in out_slices
    ]
    lora_bs = [
        rand(num_slots, width, max_rank, std=max_rank**-0.5) * keep[:, None, :].to(dtype)
        for width in out_slices
    ]
    scales = [torch.rand(num_slots, generator=gen) * 1.5 + 0.5 for _ in out_slices]
    x, y = rand(num_tokens, in_features), rand(num_tokens, sum(out_slices))
    token_slots = token_slots_for(pattern, num_tokens, num_slots, gen)
    return Case(
        x=x.to(device),
        y=y.to(device),
        lora_as=[a.to(device) for a in lora_as],
        lora_bs=[b.to(device) for b in lora_bs],
        token_slots=token_slots.to(device),
        scales=[s.to(device) for s in scales],
        slot_ranks=None if slot_ranks is None else slot_ranks.to(device),
    )


def assert_lora_result(case: Case, y_before: torch.Tensor, y_after: torch.Tensor) -> None:
    """y_after matches y_before + delta within the dtype's tolerance; rows with slot -1 bitwise unchanged."""
    tol = TOLERANCES[y_after.dtype]
    torch.testing.assert_close(y_after.double(), case.expected(), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y_after[untouched], y_before[untouched])
