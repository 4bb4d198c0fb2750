"""One rank's part of the Llama-family forward pass: the collectives around the sharded weights.

The layers run exactly as `LlamaModel`'s on this rank's heads and MLP rows; three things change:
- the embedding is vocabulary-parallel: each rank looks up the ids in its range, zeros elsewhere, and
  one all-reduce assembles the rows (exact: every row is one rank's value plus zeros);
- o and down are row-parallel: their outputs, LoRA included, are partial sums, and one all-reduce per
  layer half makes them whole. LoRA B of o/down is whole on every rank and A holds this rank's input
  columns, so each rank adds (x_r A_r^T) B^T and the all-reduce that completes the base projection also
  sums the shrink results (sum_r x_r A_r^T = x A^T): no collective of its own;
- the LM head is vocabulary-parallel: each rank computes its logits columns, gathered in rank order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.llama import LlamaModel, ModelWeights
from engine.parallel.group import ParallelGroup
from engine.parallel.plan import ShardPlan


class ShardedLlamaModel(LlamaModel):
    def __init__(
        self,
        config,
        weights: ModelWeights,
        max_positions: int,
        attention_backend: str,
        plan: ShardPlan,
        group: ParallelGroup,
    ):
        super().__init__(config, weights, max_positions, attention_backend)
        self.plan, self.group = plan, group
        self.num_heads = plan.heads_per_rank
        self.num_kv_heads = plan.kv_heads_per_rank
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.vocab_start, _ = plan.vocab_range(group.rank)

    @property
    def vocab_size(self) -> int:
        return self.plan.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.plan.vocab_per_rank)
        rows = F.embedding(local.clamp(0, self.plan.vocab_per_rank - 1), self.weights.embed)
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        local = F.linear(hidden, self.weights.lm_head)  # [n, vocab_per_rank]
        return self.group.gather_columns(local)[:, : self.plan.vocab_size].float()

    def _attention(self, i, layer, x, meta, kv_cache, lora):
        return self.group.all_reduce(super()._attention(i, layer, x, meta, kv_cache, lora))

    def _mlp(self, i, layer, x, lora):
        return self.group.all_reduce(super()._mlp(i, layer, x, lora))
