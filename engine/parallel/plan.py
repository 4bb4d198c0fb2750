"""Which slice of every weight one rank holds: the Megatron split of a decoder layer, for the checks made
before any worker starts and for cutting adapters (lora_shards.py). The layers cut their own weights
with the same `Split`s (engine/model/layers/sharding.py).

Column-parallel (split by output): q/k/v (or a fused qkv_proj, part by part), gate/up (or gate_up_proj),
and their LoRA B; each rank computes its own heads and its own slice of the MLP with no communication.
Row-parallel (split by input): o and down, and their LoRA A; each rank's output is a partial sum, made
whole by one all-reduce per layer half. The vocabulary is split too: the embedding and the LM head hold
`vocab_per_rank` rows each (the last shard zero-padded).

Example, C1 (4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512) over 4 ranks:
    rank 2: q heads [2, 3)   -> q rows [32, 48)
            KV heads [1, 2)  -> k, v rows [16, 32)   (2 KV heads < 4 ranks: each is replicated on 2 ranks)
            MLP rows [64, 96) of gate and of up; down columns [64, 96)
            vocab rows [256, 384)
    A Phi-3 qkv_proj of the same sizes: rows [32, 48), [64 + 16, 64 + 32), [96 + 16, 96 + 32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from adapter_format.model_shape import (
    SHARED_EXPERT_MODULES,
    SHARED_EXPERTS_MODULES,
    ModelShape,
    as_shared_expert,
)
from engine.model.fp8_checkpoint import fp8_scheme, is_block_scaled
from engine.model.fp8_linear import BLOCK
from engine.model.layers.linear import block_cut_message
from engine.model.layers.sharding import Split

# Projections split by input (their LoRA A too); every other target is split by output (its LoRA B).
# A shared expert (Qwen2-MoE; GLM-4.5's shared_experts) splits as a dense MLP does, whatever splits the
# routed experts.
ROW_PARALLEL = ("o_proj", "down_proj", SHARED_EXPERT_MODULES[2], SHARED_EXPERTS_MODULES[2])
COLUMN_PARALLEL = (
    *("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj"),
    *SHARED_EXPERT_MODULES[:2],
    *SHARED_EXPERTS_MODULES[:2],
)


@dataclass(frozen=True)
class ShardPlan:
    shape: ModelShape  # the whole model's
    vocab_size: int
    world_size: int
    expert_parallel: bool = False  # a mixture of experts: whole experts per rank (else a slice of each)

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
        if s.num_experts and self.expert_parallel and s.num_experts % n:
            raise ValueError(
                f"--enable-expert-parallel over {n} ranks needs the model's {s.num_experts} experts to split "
                "evenly; choose a tensor_parallel_size that divides them"
            )
        if s.num_experts and not self.expert_parallel and s.moe_intermediate_size % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the experts' intermediate size "
                f"{s.moe_intermediate_size}; choose another, or --enable-expert-parallel"
            )
        if s.intermediate_size % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's intermediate_size "
                f"{s.intermediate_size}"
            )
        if s.shared_expert_intermediate_size % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the shared expert's intermediate size "
                f"{s.shared_expert_intermediate_size}"
            )

    @classmethod
    def for_model(
        cls, hf_config, world_size: int, quantization: str | None = None, expert_parallel: bool = False
    ) -> ShardPlan:
        """The plan of a checkpoint's model (its LoRA targets from the registry), refusing splits the
        checkpoint's FP8 format cannot take: a block-scaled shard must hold whole 128-column blocks."""
        from engine.model.registry import model_class, model_shape

        plan = cls(model_shape(hf_config), hf_config.vocab_size, world_size, expert_parallel)
        dequantized = model_class(hf_config).dequantized_methods
        if (
            world_size > 1
            and fp8_scheme(hf_config, quantization, dequantized) is not None
            and is_block_scaled(hf_config)
        ):
            for module in ROW_PARALLEL:
                split = plan.input_split(module)
                if split.local_size(world_size) % BLOCK:
                    raise ValueError(block_cut_message(module, split.size, world_size))
        return plan

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
        s, n = self.shape, self.world_size
        return replace(
            s,
            intermediate_size=self.intermediate_per_rank,
            num_heads=self.heads_per_rank,
            num_kv_heads=self.kv_heads_per_rank,
            num_experts=s.num_experts // n if self.expert_parallel else s.num_experts,
            moe_intermediate_size=s.moe_intermediate_size
            if self.expert_parallel
            else s.moe_intermediate_size // n,
            shared_expert_intermediate_size=s.shared_expert_intermediate_size // n,
        )

    def expert_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the experts this rank holds (all of them without expert parallelism)."""
        if not self.expert_parallel:
            return 0, self.shape.num_experts
        return Split(self.shape.num_experts).range(rank, self.world_size)

    def expert_rows(self, rank: int) -> tuple[int, int]:
        """[start, end) of each expert's intermediate rows this rank holds (all with expert parallelism)."""
        if self.expert_parallel:
            return 0, self.shape.moe_intermediate_size
        return Split(self.shape.moe_intermediate_size).range(rank, self.world_size)

    def kv_head_start(self, rank: int) -> int:
        return self._kv_heads.range(rank, self.world_size)[0] // self.shape.head_dim

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows, end clipped to the real vocabulary."""
        start = rank * self.vocab_per_rank
        return start, min(start + self.vocab_per_rank, self.vocab_size)

    @property
    def _heads(self) -> Split:
        return Split(self.shape.num_heads, self.shape.head_dim)

    @property
    def _kv_heads(self) -> Split:
        return Split(self.shape.num_kv_heads, self.shape.head_dim, replicate=True)

    def output_parts(self, module: str) -> list[Split]:
        """The parts of a column-parallel projection's output, in order (three for a fused qkv_proj)."""
        module = as_shared_expert(module)  # either family's name, one split
        mlp = Split(self.shape.intermediate_size)
        shared = Split(self.shape.shared_expert_intermediate_size)
        parts = {
            "q_proj": [self._heads],
            "k_proj": [self._kv_heads],
            "v_proj": [self._kv_heads],
            "qkv_proj": [self._heads, self._kv_heads, self._kv_heads],
            "gate_proj": [mlp],
            "up_proj": [mlp],
            "gate_up_proj": [mlp, mlp],
            "shared_expert.gate_proj": [shared],
            "shared_expert.up_proj": [shared],
        }
        if module not in parts:
            raise ValueError(f"{module} is not column-parallel")
        return parts[module]

    def output_ranges(self, module: str, rank: int) -> list[tuple[int, int]]:
        """[start, end) of each part's rows this rank holds, in the projection's whole output."""
        ranges, offset = [], 0
        for part in self.output_parts(module):
            start, end = part.range(rank, self.world_size)
            ranges.append((offset + start, offset + end))
            offset += part.size
        return ranges

    def output_range(self, module: str, rank: int) -> tuple[int, int]:
        """[start, end) of a one-part column-parallel projection's output rows this rank holds."""
        (span,) = self.output_ranges(module, rank)
        return span

    def input_split(self, module: str) -> Split:
        module = as_shared_expert(module)
        if module == "o_proj":
            return self._heads
        if module == "down_proj":
            return Split(self.shape.intermediate_size)
        if module == "shared_expert.down_proj":
            return Split(self.shape.shared_expert_intermediate_size)
        raise ValueError(f"{module} is not row-parallel")

    def input_range(self, module: str, rank: int) -> tuple[int, int]:
        """[start, end) of a row-parallel projection's input columns this rank holds."""
        return self.input_split(module).range(rank, self.world_size)
