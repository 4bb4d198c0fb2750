"""The per-step LoRA inputs the model layers need, and how a fused projection applies them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.lora.expert_lora import ExpertLoRA
from engine.lora.pool import LoRAPool
from lora_kernels import ops, tiles
from lora_kernels.meta import LoRABatchMeta


@dataclass
class LoRAContext:
    """Built once per step by the model runner; None in steps where no token uses an adapter."""

    slots: LoRAPool
    token_slots: torch.Tensor  # [num_tokens] int32, NO_LORA (-1) for base-model tokens
    # The kernel ranks the step is sized to (LoRAPool.step_buckets); None: one launch pair for the pool's
    # kernel rank, as under tensor parallelism.
    rank_buckets: tuple[int, ...] | None = None
    # Whether the step runs the path of adapters' own embeddings and LM heads (engine/lora/vocab.py): the
    # runner's steps, decode and verification graphs do whenever the pool has vocab slots (static
    # shapes; rows of other adapters keep the base's).
    vocab: bool = False
    _meta: LoRABatchMeta | None = field(default=None, init=False)
    # The checked plan of each launch group this step (lora_kernels.ops.plan_paged), by its modules.
    _plans: dict[tuple[str, ...], ops.PagedPlan] = field(default_factory=dict, init=False)

    def own_embedding(self, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The base embedding's `rows` [tokens, hidden] with own-embedding adapters' rows in place."""
        return self.slots.vocab.embed(self.token_slots, input_ids, rows)

    def own_heads(
        self, token_rows: torch.Tensor | None = None
    ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """For the logits of these tokens' rows (None: every token's): a function (logits [rows, vocab],
        hidden [rows, hidden]) that recomputes in place the rows of adapters with their own head."""
        row_slots = self.token_slots if token_rows is None else self.token_slots[token_rows]
        return functools.partial(self.slots.vocab.head_logits, row_slots=row_slots)

    def apply(
        self,
        y: torch.Tensor,  # [num_tokens, sum(out of modules)], the fused projection's output
        x: torch.Tensor,  # [num_tokens, in]
        layer: int,
        modules: tuple[str, ...],  # the projections fused into y, in column order
    ) -> None:
        a = self.slots.launch_args(layer, modules)  # the pool's static views, built once
        plan = self._plans.get(modules)
        if plan is None:
            # Checked once a step per launch group: every layer's pools of these projections have the
            # same shapes, dtypes and strides (LoRAPool allocates them alike), and so do x and y.
            plan = self._plans[modules] = ops.plan_paged(
                y,
                x,
                a.pool_as,
                a.pool_bs,
                self.slots.page_table,
                self.token_slots,
                a.scales,
                a.output_slices,
                a.slot_ranks,
                rank_buckets=self.rank_buckets,
                dora_scales=a.dora_scales,
                dora_slots=a.dora_slots,
                meta=self._segments(),
            )
        ops.run_paged(
            plan,
            y,
            x,
            a.pool_as,
            a.pool_bs,
            self.slots.page_table,
            a.scales,
            a.slot_ranks,
            a.dora_scales,
            a.dora_slots,
        )

    def experts(self, moe, x: torch.Tensor, local_ids: torch.Tensor):
        """The routed experts' LoRA updates of one MoE layer (engine/lora/expert_lora.py), or None where
        the model has no expert targets."""
        if moe.layer is None or "experts.gate_up_proj" not in self.slots.layers[moe.layer]:
            return None
        return ExpertLoRA(
            self, moe.layer, x, local_ids, moe.spec.top_k, moe.experts.num_local, moe.runs_triton(x)
        )

    def _segments(self) -> LoRABatchMeta | None:
        """The tokens grouped by slot for the segmented kernels: the same in every layer, so built once a
        step instead of once per projection (about 25 small launches each). Only CUDA uses it."""
        num_tokens = self.token_slots.numel()
        if self.token_slots.device.type != "cuda" or tiles.choose_path(num_tokens) != "segmented":
            return None
        if self._meta is None:
            self._meta = LoRABatchMeta.build(self.token_slots, self.slots.max_loras)
        return self._meta
