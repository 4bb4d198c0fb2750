"""Which slice of every weight one rank holds: the Megatron split of a Llama-family layer.

Column-parallel (split by output): q/k/v, gate/up, and their LoRA B; each rank computes its own heads and
its own slice of the MLP with no communication. Row-parallel (split by input): o and down, and their LoRA
A; each rank's output is a partial sum, made whole by one all-reduce per layer half. The vocabulary is
split too: the embedding and the LM head hold `vocab_per_rank` rows each (the last shard zero-padded).

Example, C1 (4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512) over 4 ranks:
    rank 2: q heads [2, 3)   -> q rows [32, 48)
            KV heads [1, 2)  -> k, v rows [16, 32)   (2 KV heads < 4 ranks: each is replicated on 2 ranks)
            MLP rows [64, 96) of gate and of up; down columns [64, 96)
            vocab rows [256, 384)
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter_format.model_shape import ModelShape

# Projections split by output (their LoRA B too) and by input (their LoRA A too).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class ShardPlan:
    shape: ModelShape  # the whole model's
    vocab_size: int
    world_size: int

    def __post_init__(self) -> None:
        s, n = self.shape, self.world_size
        if s.num_heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's {s.num_heads} attention heads; "
                f"choose a tensor_parallel_size that divides {s.num_heads}"
            )
        if s.num_kv_heads % n and n % s.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {n} and the model's {s.num_kv_heads} KV heads must divide one "
                f"another (KV heads are split, or replicated when there are fewer than ranks)"
            )
        if s.intermediate_size % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's intermediate_size "
                f"{s.intermediate_size}"
            )

    @property
    def heads_per_rank(self) -> int:
        return self.shape.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.shape.num_kv_heads // self.world_size)

    @property
    def intermediate_per_rank(self) -> int:
        return self.shape.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.world_size)

    @property
    def local_shape(self) -> ModelShape:
        """One rank's projection sizes: `module_dims` of it gives every shard's (in, out)."""
        s = self.shape
        return ModelShape(
            num_layers=s.num_layers,
            hidden_size=s.hidden_size,
            intermediate_size=self.intermediate_per_rank,
            num_heads=self.heads_per_rank,
            num_kv_heads=self.kv_heads_per_rank,
            head_dim=s.head_dim,
        )

    def kv_head_start(self, rank: int) -> int:
        if self.shape.num_kv_heads >= self.world_size:
            return rank * self.kv_heads_per_rank
        return rank // (self.world_size // self.shape.num_kv_heads)  # the KV head of this rank's q heads

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows, end clipped to the real vocabulary."""
        start = rank * self.vocab_per_rank
        return start, min(start + self.vocab_per_rank, self.vocab_size)

    def output_range(self, module: str, rank: int) -> tuple[int, int]:
        """[start, end) of a column-parallel projection's output rows this rank holds."""
        d = self.shape.head_dim
        if module == "q_proj":
            return _span(rank, self.heads_per_rank * d)
        if module in ("k_proj", "v_proj"):
            start = self.kv_head_start(rank) * d
            return start, start + self.kv_heads_per_rank * d
        if module in ("gate_proj", "up_proj"):
            return _span(rank, self.intermediate_per_rank)
        raise ValueError(f"{module} is not column-parallel")

    def input_range(self, module: str, rank: int) -> tuple[int, int]:
        """[start, end) of a row-parallel projection's input columns this rank holds."""
        if module == "o_proj":
            return self.output_range("q_proj", rank)
        if module == "down_proj":
            return self.output_range("gate_proj", rank)
        raise ValueError(f"{module} is not row-parallel")


def _span(rank: int, size: int) -> tuple[int, int]:
    return rank * size, (rank + 1) * size
