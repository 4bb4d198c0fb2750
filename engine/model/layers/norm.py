"""RMSNorm as transformers computes it, Llama's (`weight * normed`, normalised in float32 and rounded to
the model dtype first) or Gemma's (`normed * (1 + weight)` in float32, rounded once); on the Triton path
one kernel with the residual add folded in (engine/model/fused_ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model import fused_ops
from engine.model.layers.context import BuildContext
from engine.model.layers.linear import check_shape, new_param, refuse_float8
from engine.model.layers.sharding import PartialSums


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ctx: BuildContext, offset: bool = False):
        super().__init__()
        self.size, self.eps, self.offset, self.fused = size, eps, offset, ctx.fused
        self.weight = new_param((size,), ctx.dtype, ctx.device, self._load)

    def forward(
        self, x: torch.Tensor | PartialSums, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or with `residual`: (norm(residual + x), residual + x), the sum stored into `residual`
        in place on the fused path (vLLM's fused add). `x` may be a row-parallel layer's partial sums: the
        all-reduce then happens here, fused with the add and the norm where it can be."""
        if isinstance(x, PartialSums):
            if residual is None:
                x = x.reduce()
            else:
                return x.tp.reduce_add_norm(x, residual, self)
        if self.fused and x.dim() == 2:
            out = fused_ops.rms_norm(x, self.weight, self.eps, residual, self.offset)
            return out if residual is None else (out, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset)
        residual = residual + x
        return rms_norm(residual, self.weight, self.eps, self.offset), residual

    def _load(self, param, tensor, shard) -> None:
        check_shape(tensor, (self.size,))
        if tensor.is_float8:
            refuse_float8(tensor)
        param.data.copy_(tensor.rows(0, self.size))
        param.loaded.add(None)
