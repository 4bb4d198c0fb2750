"""RMSNorm of q (or k) over all heads at once, as OLMoE normalises them (Qwen3's and Gemma 3's norms are
per head): the weight spans every head's rows, `q_norm.weight` [num_heads * head_dim] and
`k_norm.weight` [num_kv_heads * head_dim].

Under tensor parallelism each rank holds its heads' rows of the weight and of q; the mean of squares
spans every head, so each rank's sum of squares is all-reduced first (q's and k's in one all-reduce:
`norm_q_and_k`). KV heads replicated over several ranks (fewer KV heads than ranks) are counted once:
the summed squares are divided by the replication.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.context import BuildContext
from engine.model.layers.linear import check_shape, new_param, refuse_float8
from engine.model.layers.sharding import Split


class WholeHeadsRMSNorm(nn.Module):
    def __init__(self, heads: Split, eps: float, ctx: BuildContext):
        super().__init__()
        self.heads, self.eps, self.tp = heads, eps, ctx.tp
        n = ctx.tp.world_size
        self.start, self.end = heads.range(ctx.tp.rank, n)
        # how many ranks hold each head: 1 when the heads split, n / heads when replicated
        self.copies = 1 if heads.units % n == 0 else n // heads.units
        self.weight = new_param((self.end - self.start,), ctx.dtype, ctx.device, self._load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, local heads, head_dim], same out
        return self.scale(x, self.tp.all_reduce(self.sum_of_squares(x)))

    def sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, local heads, head_dim] -> [tokens, 1] float32: this rank's heads' share."""
        return x.reshape(x.shape[0], -1).float().pow(2).sum(-1, keepdim=True)

    def scale(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """x normalised by `squares` [tokens, 1], the sum over every rank (replicated heads `copies` times)."""
        mean = squares / self.copies / self.heads.size
        normed = x.reshape(x.shape[0], -1).float() * torch.rsqrt(mean + self.eps)
        return (self.weight * normed.to(x.dtype)).view_as(x)

    def _load(self, param, tensor, shard) -> None:
        check_shape(tensor, (self.heads.size,))
        if tensor.is_float8:
            refuse_float8(tensor)
        param.data.copy_(tensor.rows(self.start, self.end))
        param.loaded.add(None)


def norm_q_and_k(
    q_norm: WholeHeadsRMSNorm, k_norm: WholeHeadsRMSNorm, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both norms with one all-reduce (of both sums of squares, [tokens, 2]) instead of two per layer."""
    if q_norm.tp.world_size == 1:
        return q_norm(q), k_norm(k)
    squares = torch.cat([q_norm.sum_of_squares(q), k_norm.sum_of_squares(k)], dim=-1)
    squares = q_norm.tp.all_reduce(squares)
    return q_norm.scale(q, squares[:, :1]), k_norm.scale(k, squares[:, 1:])
