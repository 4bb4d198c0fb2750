"""A mixture-of-experts block (Qwen3-MoE, Mixtral, OLMoE, gpt-oss; Qwen2-MoE and GLM-4.5 add shared
experts: shared_expert.py, grouped_topk_moe.py): a router picks each token's top-k experts, each expert is
a gated MLP, and the token's output is the routing-weighted sum of its experts' outputs.

    logits = x @ gate^T (+ gate.bias)        [tokens, E], replicated on every rank
    probs  = softmax(logits in float32); w, ids = top-k(probs); w /= sum(w) if `renormalize`
    y      = sum_k w_k * down_e(SiLU(gate_e(x)) * up_e(x)),  e = ids_k   (engine/model/moe_kernels.py)
gpt-oss adds biases to the router and to each expert's projections, and its own activation (the clamped
SwiGLU, MoESpec.activation); its softmax over the top-k logits is the renormalized top-k probabilities.

Parameters, by their transformers-5 names (the fused checkpoint layout loads as is):
    mlp.gate.weight               [E, H]
    mlp.experts.gate_up_proj      [E_local, 2 * I_local, H]   gate rows, then up rows
    mlp.experts.down_proj         [E_local, H, I_local]
    mlp.experts.gate_up_proj_bias [E_local, 2 * I_local], down_proj_bias [E_local, H] (expert_bias)
A hub checkpoint's per-expert tensors (`mlp.experts.3.gate_proj.weight`; Mixtral's w1/w3/w2) each fill
one expert's part of them: their weight loaders take the part as (expert, 0 gate | 1 up | None down).

Over several ranks (attention tensor-parallel, tokens replicated on every rank) the experts are split
either by their intermediate rows (tensor parallel, vLLM's default: every rank holds a slice of every
expert) or, with expert parallelism, whole experts per rank (rank r holds experts [r E/n, (r+1) E/n)).
Either way each rank's output is a partial sum that one all-reduce completes, as a row-parallel
projection's is: exact against one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import moe_kernels
from engine.model.layers.context import BuildContext
from engine.model.layers.linear import check_shape, new_param
from engine.model.layers.sharding import PartialSums, Split
from lora_kernels.tiles import interpreting

# The parts of one expert's gated MLP in a per-expert checkpoint, by its name for them.
EXPERT_PARTS = {"gate_proj": 0, "up_proj": 1, "down_proj": None}


def refuse_float8_experts(tensor) -> None:
    if tensor.is_float8:
        raise ValueError(
            f"checkpoint tensor {tensor.name!r} is float8 but config.json's quantization_config does not "
            "describe an FP8 checkpoint (whose float8 experts are dequantized at load)"
        )


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    activation: str = "silu"  # or "clamped_swiglu" (gpt-oss, with swiglu_alpha and swiglu_limit)
    router_bias: bool = False  # `mlp.gate.bias` [E] (gpt-oss's router)
    expert_bias: bool = False  # `experts.gate_up_proj_bias` [E, 2I] and `experts.down_proj_bias` [E, H]
    # clamped_swiglu: (up + 1) * gate * sigmoid(alpha * gate), after gate <= limit and -limit <= up <= limit;
    # the defaults are gpt-oss's reference values (configs that predate the fields use them).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def activation_args(self) -> dict:
        """What the kernels take for the activation (moe_kernels.gate_up_act's `limit` and `alpha`)."""
        if self.activation == "clamped_swiglu":
            return {"limit": self.swiglu_limit, "alpha": self.swiglu_alpha}
        return {}


class Router(nn.Module):
    """The replicated linear router `gate` (with a bias where the spec says: gpt-oss)."""

    def __init__(self, num_experts: int, hidden_size: int, ctx: BuildContext, bias: bool = False):
        super().__init__()
        self.weight = new_param((num_experts, hidden_size), ctx.dtype, ctx.device, self._load)
        self.bias = new_param((num_experts,), ctx.dtype, ctx.device, self._load) if bias else None

    def _load(self, param, tensor, shard) -> None:
        check_shape(tensor, tuple(param.shape))
        refuse_float8_experts(tensor)
        param.data.copy_(tensor.read())
        param.loaded.add(None)


class Experts(nn.Module):
    """This rank's experts (or its slice of every expert), stacked as transformers 5 stacks them."""

    def __init__(self, spec: MoESpec, hidden_size: int, ctx: BuildContext, expert_parallel: bool):
        super().__init__()
        tp, n = ctx.tp, ctx.tp.world_size
        self.hidden_size = hidden_size
        self.spec = spec
        if expert_parallel:
            experts, rows = Split(spec.num_experts), Split(spec.intermediate_size)
            self.expert_start, self.expert_end = experts.range(tp.rank, n)
            self.row_start, self.row_end = 0, spec.intermediate_size
        else:
            rows = Split(spec.intermediate_size)
            self.expert_start, self.expert_end = 0, spec.num_experts
            self.row_start, self.row_end = rows.range(tp.rank, n)
        local_e, local_i = self.expert_end - self.expert_start, self.row_end - self.row_start
        self.num_local = local_e
        parts = [(e, p) for e in range(self.expert_start, self.expert_end) for p in (0, 1)]
        self.gate_up_proj = new_param(
            (local_e, 2 * local_i, hidden_size), ctx.dtype, ctx.device, self._load_gate_up, parts
        )
        down_parts = [(e, None) for e in range(self.expert_start, self.expert_end)]
        self.down_proj = new_param(
            (local_e, hidden_size, local_i), ctx.dtype, ctx.device, self._load_down, down_parts
        )
        self.gate_up_proj_bias = self.down_proj_bias = None
        if spec.expert_bias:  # gate rows then up rows, as the weight; down's added by one rank only
            self.gate_up_proj_bias = new_param((local_e, 2 * local_i), ctx.dtype, ctx.device, self._load_bias)
            self.down_proj_bias = new_param((local_e, hidden_size), ctx.dtype, ctx.device, self._load_bias)
            # Intermediate rows split over ranks: every rank's output is a partial sum of every expert's,
            # so rank 0 alone adds down's bias (as a row-parallel projection's).
            self._down_bias_here = expert_parallel or tp.rank == 0

    def _local(self, expert: int) -> int | None:
        return expert - self.expert_start if self.expert_start <= expert < self.expert_end else None

    def _load_gate_up(self, param, tensor, shard) -> None:
        refuse_float8_experts(tensor)
        inter, local_i = self.spec.intermediate_size, self.row_end - self.row_start
        if shard is None:  # the fused [E, 2I, H] tensor
            check_shape(tensor, (self.spec.num_experts, 2 * inter, self.hidden_size))
            whole = tensor.rows(self.expert_start, self.expert_end)  # this rank's experts only
            for part in (0, 1):
                start = part * inter
                rows = whole[:, start + self.row_start : start + self.row_end]
                param.data[:, part * local_i : (part + 1) * local_i].copy_(rows)
            param.loaded.update((e, p) for e in range(self.expert_start, self.expert_end) for p in (0, 1))
            return
        expert, part = shard
        check_shape(tensor, (inter, self.hidden_size))
        local = self._local(expert)
        if local is None:
            return  # another rank's expert
        rows = tensor.rows(self.row_start, self.row_end)
        param.data[local, part * local_i : (part + 1) * local_i].copy_(rows)
        param.loaded.add(shard)

    def _load_bias(self, param, tensor, shard) -> None:
        """The fused [E, 2I] (gate then up) or [E, H] bias: this rank's experts, and its gate/up rows."""
        refuse_float8_experts(tensor)
        inter, gate_up = self.spec.intermediate_size, param is self.gate_up_proj_bias
        check_shape(tensor, (self.spec.num_experts, 2 * inter if gate_up else self.hidden_size))
        whole = tensor.rows(self.expert_start, self.expert_end)
        if gate_up:
            start, end = self.row_start, self.row_end
            param.data.copy_(torch.cat([whole[:, start:end], whole[:, inter + start : inter + end]], 1))
        elif self._down_bias_here:
            param.data.copy_(whole)
        else:
            param.data.zero_()
        param.loaded.add(None)

    def _load_down(self, param, tensor, shard) -> None:
        refuse_float8_experts(tensor)
        inter = self.spec.intermediate_size
        if shard is None:  # the fused [E, H, I] tensor
            check_shape(tensor, (self.spec.num_experts, self.hidden_size, inter))
            whole = tensor.rows(self.expert_start, self.expert_end)
            param.data.copy_(whole[:, :, self.row_start : self.row_end])
            param.loaded.update((e, None) for e in range(self.expert_start, self.expert_end))
            return
        expert, _ = shard
        check_shape(tensor, (self.hidden_size, inter))
        local = self._local(expert)
        if local is None:
            return
        param.data[local].copy_(tensor.cols(self.row_start, self.row_end))
        param.loaded.add(shard)


class SparseMoE(nn.Module):
    """Router + experts with `forward(x, lora)`, a decoder layer's MLP (engine/model/layers/decoder.py)."""

    def __init__(self, spec: MoESpec, hidden_size: int, ctx: BuildContext, backend: str | None = None):
        super().__init__()
        if spec.activation not in moe_kernels.MOE_ACTIVATIONS:
            raise ValueError(
                f"expert activation {spec.activation!r} is not supported; supported: "
                f"{', '.join(moe_kernels.MOE_ACTIVATIONS)}"
            )
        if spec.num_experts % ctx.tp.world_size and ctx.expert_parallel:
            raise ValueError(
                f"--enable-expert-parallel over {ctx.tp.world_size} ranks needs the number of experts "
                f"({spec.num_experts}) to be a multiple of tensor_parallel_size"
            )
        self.spec, self.tp, self.ctx = spec, ctx.tp, ctx
        self._activation = spec.activation_args()  # once, not per step: the kernels' limit / alpha
        self.gate = Router(spec.num_experts, hidden_size, ctx, spec.router_bias)
        self.experts = Experts(spec, hidden_size, ctx, ctx.expert_parallel)
        self.layer: int | None = None  # set by the model: the LoRA pool's layer index
        self.defer_reduce = False  # set by the model: forward returns PartialSums (RowParallelLinear's)
        # The Triton kernels on CUDA and on the Triton path (interpreted on the CPU); the torch path elsewhere.
        triton_path = ctx.device.type == "cuda" or ctx.attention_backend == "triton"
        self.backend = backend or ("triton" if triton_path else "torch")
        # [E] int64: tokens routed to each expert since the start (a row of the model's RoutingCounts);
        # `count_mask` [T] bool leaves out CUDA-graph padding rows (set per forward by the model).
        self.routed_tokens: torch.Tensor | None = None
        self.count_mask: torch.Tensor | None = None

    def runs_triton(self, x: torch.Tensor) -> bool:
        """Whether a forward over x runs the Triton kernels, fused MoE and expert LoRA
        (lora_kernels/expert_kernels.py) alike: the one place the path is chosen."""
        return self.backend == "triton" and (x.is_cuda or interpreting())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] float32, expert ids [T, K]) of each token's top-k experts."""
        logits = F.linear(x, self.gate.weight, self.gate.bias)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.reduce(self.routed(x, lora))

    def routed(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # [T, H] -> [T, H], this rank's part
        """The routed experts' sum over each token's top k, before the all-reduce (a partial sum over
        the ranks' experts or expert rows)."""
        num_tokens = x.shape[0]
        top_k = self.spec.top_k
        weights, ids = self.route(x)
        if self.routed_tokens is not None:
            counted = ids if self.count_mask is None else torch.where(self.count_mask[:, None], ids, -1)
            self.routed_tokens.add_(moe_kernels.expert_counts(counted, self.spec.num_experts))
        experts = self.experts
        local = ids - experts.expert_start
        local = torch.where((local >= 0) & (local < experts.num_local), local, experts.num_local).reshape(-1)
        flat_weights = weights.reshape(-1)  # float32
        expert_lora = None if lora is None else lora.experts(self, x, local)
        gate_up_delta = None if expert_lora is None else expert_lora.gate_up()
        act = self._activation
        if self.runs_triton(x):
            block_m = moe_kernels.block_rows(local.numel(), experts.num_local)
            rows, block_expert = moe_kernels.align_by_expert(local, experts.num_local, block_m)
            inter = moe_kernels.gate_up_act(
                x,
                experts.gate_up_proj,
                rows,
                block_expert,
                top_k,
                gate_up_delta,
                experts.gate_up_proj_bias,
                **act,
            )
            down_delta = None if expert_lora is None else expert_lora.down(inter)
            out = moe_kernels.down_weighted(
                inter, experts.down_proj, flat_weights, rows, block_expert, down_delta, experts.down_proj_bias
            )
        else:
            inter = moe_kernels.gate_up_act_torch(
                x, experts.gate_up_proj, local, top_k, gate_up_delta, experts.gate_up_proj_bias, **act
            )
            down_delta = None if expert_lora is None else expert_lora.down(inter)
            out = moe_kernels.down_weighted_torch(
                inter, experts.down_proj, flat_weights, local, down_delta, experts.down_proj_bias
            )
        return out.view(num_tokens, top_k, -1).sum(dim=1)

    def reduce(self, y: torch.Tensor) -> torch.Tensor | PartialSums:
        """This rank's partial sums made whole: now, or by the next norm (defer_reduce)."""
        if self.defer_reduce:  # the next norm all-reduces (RowParallelLinear.defer_reduce)
            return PartialSums(y, None, self.tp)
        return self.tp.all_reduce(y)
