"""A mixture of experts with a shared expert beside the routed ones (Qwen2-MoE): every token also goes
through one gated MLP, weighed by its own sigmoid gate, and that is added to the routed experts' sum.

    y = sum_k w_k * expert_e(x)  +  sigmoid(x @ shared_expert_gate^T) * shared_expert(x)

Parameters, by their checkpoint names (besides SparseMoE's `mlp.gate` and `mlp.experts.*`):
    mlp.shared_expert.gate_up_proj   [2 * I_shared, H]   from gate_proj and up_proj, as a dense MLP's
    mlp.shared_expert.down_proj      [H, I_shared]
    mlp.shared_expert_gate.weight    [1, H]              replicated on every rank

Over several ranks the shared expert splits as a dense MLP does (its intermediate rows), whether the
routed experts split by rows or whole (expert parallelism); its gate is replicated, so the gated shared
output of each rank is a partial sum too, and one all-reduce completes both sums. LoRA on the shared
expert is the dense path's (its projections' `lora_modules`, set by the model); its gate takes none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers.context import BuildContext
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.moe import MoESpec, Router, SparseMoE
from engine.model.layers.sharding import PartialSums


class SharedExpertMoE(SparseMoE):
    def __init__(
        self,
        spec: MoESpec,
        hidden_size: int,
        shared_intermediate_size: int,
        ctx: BuildContext,
        backend: str | None = None,
    ):
        super().__init__(spec, hidden_size, ctx, backend)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, spec.activation, ctx)
        # Its partial sums are added to the routed experts' before the block's one all-reduce.
        self.shared_expert.down_proj.defer_reduce = True
        self.shared_expert_gate = Router(1, hidden_size, ctx)  # a replicated [1, H] linear, no bias

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor | PartialSums:  # [T, H] -> [T, H]
        y = self.routed(x, lora)
        shared = self.shared_expert(x, lora)
        if isinstance(shared, PartialSums):  # several ranks: this rank's rows' share
            shared = shared.values
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))  # [T, 1]
        return self.reduce(y + gate * shared)
