"""DeepSeek-V3-style routing with always-on shared experts (GLM-4.5 / GLM-4.6): a sigmoid router whose
choice is biased and limited to the best expert groups, and a shared gated MLP added to the routed sum with
no gate of its own (Qwen2-MoE's shared expert has a sigmoid `shared_expert_gate`).

    logits = x @ gate^T (float32)          s = sigmoid(logits)                        [T, E]
    choice = s + e_score_correction_bias   (the bias steers the choice only, never the weights)
    groups: E experts in n_group groups; a group's score is the sum of its best two choice scores; only
            the topk_group best groups stay, the others' experts are masked out of the top-k
    ids    = top-k(choice)                 w = s[ids]; w /= sum(w) + 1e-20 if norm_topk_prob
    w     *= routed_scaling_factor
    y      = sum_k w_k * expert_ids_k(x) + shared_experts(x)

Parameters, by their checkpoint names (besides SparseMoE's `mlp.experts.*`):
    mlp.gate.weight                      [E, H]    float32, as transformers and vLLM keep it
    mlp.gate.e_score_correction_bias     [E]       float32
    mlp.shared_experts.gate_up_proj      [2 * I_shared, H]   from gate_proj and up_proj
    mlp.shared_experts.down_proj         [H, I_shared]       I_shared = moe_intermediate_size * n_shared_experts

The router is replicated on every rank; the shared MLP splits as a dense MLP does (its intermediate rows),
so its output is a partial sum that joins the routed experts' in the block's one all-reduce (as
shared_expert.py's). LoRA on the shared MLP is the dense path's (its projections' `lora_modules`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.context import BuildContext
from engine.model.layers.linear import check_shape, new_param
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.moe import MoESpec, SparseMoE, refuse_float8_experts
from engine.model.layers.sharding import PartialSums


@dataclass(frozen=True)
class GroupedTopK:
    """The routing settings of the config (n_group, topk_group, routed_scaling_factor)."""

    num_groups: int
    top_groups: int
    scaling: float


class BiasedSigmoidRouter(nn.Module):
    """The replicated router `gate` in float32, with its choice-only bias `e_score_correction_bias`."""

    def __init__(self, num_experts: int, hidden_size: int, ctx: BuildContext):
        super().__init__()
        self.weight = new_param((num_experts, hidden_size), torch.float32, ctx.device, self._load)
        self.e_score_correction_bias = new_param((num_experts,), torch.float32, ctx.device, self._load)

    def _load(self, param, tensor, shard) -> None:
        check_shape(tensor, tuple(param.shape))
        refuse_float8_experts(tensor)
        param.data.copy_(tensor.read())  # to float32 whatever the checkpoint's dtype
        param.loaded.add(None)


def grouped_top_k(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, routing: GroupedTopK, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] float32, expert ids [T, K]) from router logits [T, E] float32 (the module's maths)."""
    scores = logits.sigmoid()
    choice = scores + bias
    tokens, num_experts = choice.shape
    if routing.num_groups > 1:  # shapes fixed, no host sync: decode steps capture as CUDA graphs
        size = num_experts // routing.num_groups
        grouped = choice.view(tokens, routing.num_groups, size)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        kept = group_scores.topk(routing.top_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, n_group]
        choice = grouped.masked_fill(~keep[:, :, None], -torch.inf).view(tokens, num_experts)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


class GroupedTopKMoE(SparseMoE):
    def __init__(
        self,
        spec: MoESpec,
        routing: GroupedTopK,
        hidden_size: int,
        shared_intermediate_size: int,
        ctx: BuildContext,
        backend: str | None = None,
    ):
        super().__init__(spec, hidden_size, ctx, backend)
        self.routing = routing
        self.gate = BiasedSigmoidRouter(spec.num_experts, hidden_size, ctx)
        self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, spec.activation, ctx)
        # Its partial sums are added to the routed experts' before the block's one all-reduce.
        self.shared_experts.down_proj.defer_reduce = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight)  # [T, E] float32
        return grouped_top_k(
            logits, self.gate.e_score_correction_bias, self.spec.top_k, self.routing, self.spec.renormalize
        )

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor | PartialSums:  # [T, H] -> [T, H]
        y = self.routed(x, lora)
        shared = self.shared_experts(x, lora)
        if isinstance(shared, PartialSums):  # several ranks: this rank's rows' share
            shared = shared.values
        return self.reduce(y + shared)
