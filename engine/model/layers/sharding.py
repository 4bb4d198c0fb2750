"""How one dimension of a weight is cut over the tensor-parallel ranks, and the ranks' collectives.

A dimension is `units` of `unit_size` rows: attention heads of head_dim rows, or single rows (the MLP's
intermediate size, the vocabulary). The ranks divide the units evenly; KV heads may instead be fewer
than the ranks, and are then replicated (rank r keeps the KV head its query heads read). The model's
layers cut their weights with `Split.range` and the LoRA shards (engine/parallel/lora_shards.py) cut
adapters with the same function, so the two always agree.

Example, 4 heads of 16 rows and 2 KV heads over 4 ranks: rank 2 holds q rows [32, 48) and k/v rows
[16, 32) (KV head 1, shared with rank 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Split:
    units: int
    unit_size: int = 1
    replicate: bool = False  # fewer units than ranks: each unit on world_size / units ranks (KV heads)

    @property
    def size(self) -> int:
        return self.units * self.unit_size

    def units_per_rank(self, world_size: int) -> int:
        if self.units % world_size == 0:
            return self.units // world_size
        if self.replicate and world_size % self.units == 0:
            return 1
        raise ValueError(f"{self.units} units cannot be split over {world_size} ranks")

    def local_size(self, world_size: int) -> int:
        return self.units_per_rank(world_size) * self.unit_size

    def range(self, rank: int, world_size: int) -> tuple[int, int]:
        """[start, end) of the rows (or columns) rank `rank` holds."""
        per = self.units_per_rank(world_size)
        first = rank * per if self.units >= world_size else rank // (world_size // self.units)
        return first * self.unit_size, (first + per) * self.unit_size


class Collectives(Protocol):
    """What the layers need of a process group (engine.parallel.group.ParallelGroup)."""

    group: object
    # The all-reduce fused with the residual add and RMSNorm, or None (engine/parallel/fused_allreduce.py).
    fused_add_norm: object | None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class PartialSums:
    """A row-parallel layer's output before its all-reduce (o_proj, down_proj, a MoE block), when the
    RMSNorm that follows completes it: one fused call (TensorParallel.reduce_add_norm) instead of NCCL's
    all-reduce, the bias add and the norm's own kernel. Only the model's norms take it."""

    values: torch.Tensor  # [tokens, hidden]: this rank's partial sums
    bias: torch.Tensor | None  # [hidden]: added once, after the sum
    tp: TensorParallel

    def reduce(self) -> torch.Tensor:  # [tokens, hidden]
        """The sum over the ranks (+ bias), as the layer would have returned it."""
        x = self.tp.all_reduce(self.values)
        return x if self.bias is None else x + self.bias


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks; world_size 1 (no group) runs no collective."""

    rank: int = 0
    world_size: int = 1
    group: Collectives | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (row-parallel partial outputs)."""
        return x if self.group is None else self.group.all_reduce(x)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:  # [n, cols] -> [n, world_size * cols]
        return x if self.group is None else self.group.gather_columns(x)

    @property
    def fuses_add_norm(self) -> bool:
        """Whether row-parallel layers hand their partial sums to the next norm (PartialSums)."""
        return self.group is not None and getattr(self.group, "fused_add_norm", None) is not None

    def reduce_add_norm(
        self, sums: PartialSums, residual: torch.Tensor, norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + sum + bias), residual + sum + bias), the sum stored into `residual`: the fused
        kernel where it takes this input (FusedAllReduceNorm.fits decides), else NCCL's all-reduce, the
        bias add and `norm(x, residual)`, exactly the ops of an unfused layer."""
        fused = self.group.fused_add_norm
        if fused.fits(sums.values):
            return fused(sums.values, residual, norm.weight, norm.eps, norm.offset, sums.bias), residual
        return norm(sums.reduce(), residual)

    def all_max_(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the ranks, in place (used while loading, never in a step)."""
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group.group)
        return x


SINGLE = TensorParallel()
