"""The token embedding and the LM head, both split by vocabulary over the ranks.

Each rank holds `vocab_per_rank` rows (the last shard zero-padded when the ranks do not divide the
vocabulary). The embedding looks up the ids in its range, zeros elsewhere, and one all-reduce assembles
the rows (exact: every row is one rank's value plus zeros); the LM head computes its logits columns, and
an all-gather joins them in rank order (padding columns are cut off, never sampled).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.context import BuildContext
from engine.model.layers.linear import check_shape, new_param, refuse_float8


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: BuildContext, scale: float | None = None):
        """`scale`: multiply the rows by it, rounded to the model dtype first (Gemma's sqrt(hidden))."""
        super().__init__()
        tp = ctx.tp
        self.tp, self.vocab_size, self.hidden_size = tp, vocab_size, hidden_size
        self.vocab_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.vocab_per_rank
        self.weight = new_param((self.vocab_per_rank, hidden_size), ctx.dtype, ctx.device, self._load)
        self.scale = None if scale is None else torch.tensor(scale, dtype=ctx.dtype, device=ctx.device)

    def forward(self, input_ids: torch.Tensor, own=None) -> torch.Tensor:  # [tokens] -> [tokens, hidden]
        """`own`: a function (input_ids, rows) -> rows that puts adapters' own embedding rows in place of
        the base's (LoRAContext.own_embedding), before the scale, as PEFT's copy of a scaled embedding
        scales its rows (engine/lora/vocab.py). Under tensor parallelism it reads this rank's shard of
        the adapters' rows with the local ids, before the mask and the all-reduce, as the base rows."""
        if self.tp.world_size == 1:
            rows = F.embedding(input_ids, self.weight)
            if own is not None:
                rows = own(input_ids, rows)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.vocab_per_rank)
            local = local.clamp(0, self.vocab_per_rank - 1)
            rows = F.embedding(local, self.weight)
            if own is not None:
                rows = own(local, rows)
            rows = self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))
        return rows if self.scale is None else rows * self.scale

    def _load(self, param, tensor, shard) -> None:
        check_shape(tensor, (self.vocab_size, self.hidden_size))
        if tensor.is_float8:
            refuse_float8(tensor)
        end = min(self.vocab_start + self.vocab_per_rank, self.vocab_size)
        rows = tensor.rows(self.vocab_start, end)
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()  # padding of the last shard: never a real token
        param.loaded.add(None)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary columns, gathered over the ranks; its own weight, or the
    embedding's when tied."""

    def __init__(
        self,
        embedding: VocabParallelEmbedding,
        ctx: BuildContext,
        tied: bool,
        softcap: float | None = None,  # Gemma 2/3's final_logit_softcapping: cap * tanh(logits / cap)
    ):
        super().__init__()
        self.tp, self.vocab_size, self.softcap = ctx.tp, embedding.vocab_size, softcap
        self._embedding = [embedding]  # a list: not a submodule (its weight is the embedding's, not ours)
        if not tied:
            self.weight = new_param(embedding.weight.shape, ctx.dtype, ctx.device, embedding._load)
        else:
            self.weight = None

    def tie(self) -> None:
        """Use the embedding's rows (a checkpoint without lm_head.weight): frees this head's own."""
        self.weight = None

    def forward(self, hidden: torch.Tensor, own=None) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        """`own`: a function (logits, hidden) that recomputes in place the rows of adapters with their own
        head (LoRAContext.own_heads) in this rank's columns, before the all-gather and the soft cap, which
        applies to them as to every row."""
        weight = self._embedding[0].weight if self.weight is None else self.weight
        logits = F.linear(hidden, weight)  # [n, vocab_per_rank]
        if own is not None:  # one launch, static shapes (engine/lora/vocab.py)
            own(logits, hidden)
        if self.tp.world_size > 1:
            logits = self.tp.gather_columns(logits)[:, : self.vocab_size]
        logits = logits.float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
