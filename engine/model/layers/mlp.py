"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused in one column-parallel projection.

`activation` is the checkpoint's name for it: "silu" (SwiGLU: Llama, Qwen, Mistral, Phi) or
"gelu_pytorch_tanh" (GeGLU: Gemma). An architecture with another MLP (a mixture of experts) builds its
own block with the same `forward(x, lora)` and plugs it into the decoder layer (decoder.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import fused_ops
from engine.model.layers.context import BuildContext
from engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.model.layers.sharding import Split


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:  # [t, 2 * w] -> [t, w]
    gate, up = gate_up.chunk(2, dim=-1)
    if activation in ("silu", "swish"):
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str, ctx: BuildContext, bias: bool = False
    ):
        super().__init__()
        if activation not in fused_ops.ACTIVATIONS:
            raise ValueError(
                f"MLP activation {activation!r} is not supported; supported: {', '.join(fused_ops.ACTIVATIONS)}"
            )
        rows = Split(intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [rows, rows], ctx, bias)
        self.down_proj = RowParallelLinear(rows, hidden_size, ctx, bias)
        self.activation, self.fused = activation, ctx.fused

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # [tokens, hidden]
        gate_up = self.gate_up_proj(x, lora)
        if self.fused:
            act = fused_ops.act_and_mul(gate_up, self.activation)
        else:
            act = act_and_mul(gate_up, self.activation)
        return self.down_proj(act, lora)
