"""What every mixture-of-experts architecture adds to the decoder (engine/model/layers/decoder.py): MoE
layers built from the config, the checkpoint names of their experts in both layouts, and the routed
experts as LoRA targets.

Checkpoint layouts, both loaded as they are:
- per expert, as on the hub: `mlp.experts.E.gate_proj.weight`, `up_proj`, `down_proj` (Mixtral:
  `block_sparse_moe.experts.E.w1/w3/w2.weight`, `block_sparse_moe.gate.weight`), each filling one
  expert's part of the stacked parameters;
- fused, as transformers 5 holds them: `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
  [E, H, I], each a whole stacked parameter.
An FP8 checkpoint's routed experts (float8 with their scales, either layout) are dequantized to the model
dtype at load (engine/model/fp8_experts.py), as is a float8 router; everything else FP8 stays FP8.
LoRA targets: the attention projections, the routed experts' stacked `experts.gate_up_proj` and
`experts.down_proj`, which PEFT adapts with `target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"]`, and where the model has dense layers their MLPs' gate_proj, up_proj and
down_proj (the pool holds those pairs in every layer; an adapter may have them on the dense layers only).
"""

from __future__ import annotations

import re
from functools import partial

import torch

from engine.model.fp8_checkpoint import ON_THE_FLY
from engine.model.fp8_experts import dequantize_experts
from engine.model.layers.decoder import DecoderModel
from engine.model.layers.moe import EXPERT_PARTS, Experts, MoESpec, SparseMoE
from engine.model.moe_kernels import block_rows

EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")


class MoEDecoderModel(DecoderModel):
    # Checkpoint names of an expert's parts where the family differs from gate_proj/up_proj/down_proj.
    expert_part_names: dict[str, str] = {}
    # A family with shared experts: their gate_proj, up_proj and down_proj under the MoE block's attribute
    # for them (Qwen2-MoE's `shared_expert.*`, GLM-4.5's `shared_experts.*`), LoRA targets of their own.
    shared_expert_targets: tuple[str, ...] = ()

    @classmethod
    def lora_targets(cls, config=None) -> tuple[str, ...]:
        """The attention projections, the dense layers' MLPs where `config` has dense layers (GLM-4.5's
        first_k_dense_replace, Qwen3-MoE's mlp_only_layers), the routed experts and any shared experts."""
        dense = ("gate_proj", "up_proj", "down_proj")
        attention = tuple(m for m in super().lora_targets() if m not in dense)
        mlp = dense if config is not None and cls.dense_layers(config) else ()
        return (*attention, *mlp, *EXPERT_TARGETS, *cls.shared_expert_targets)

    def moe_spec(self, config) -> MoESpec:
        raise NotImplementedError

    @classmethod
    def is_moe_layer(cls, config, layer: int) -> bool:
        return True

    @classmethod
    def dense_layers(cls, config) -> tuple[int, ...]:
        """The layers whose MLP is a dense gated MLP of intermediate_size (no experts)."""
        return tuple(i for i in range(config.num_hidden_layers) if not cls.is_moe_layer(config, i))

    def build_mlp(self, config, layer, ctx):
        if not self.is_moe_layer(config, layer):
            return super().build_mlp(config, layer, ctx)
        return SparseMoE(self.moe_spec(config), config.hidden_size, ctx)

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.moe_layers = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.layer = i
        self.routing = RoutingCounts(self.moe_layers, ctx.device)
        # The decoder names a projection's LoRA targets by its own name (gate_up_proj -> gate_proj,
        # up_proj); the shared experts' are their own targets.
        gate, up, down = self.shared_expert_targets or (None,) * 3
        for moe in self.moe_layers if gate else ():
            shared = getattr(moe, gate.split(".")[0])
            shared.gate_up_proj.lora_modules, shared.down_proj.lora_modules = (gate, up), (down,)

    def forward(self, input_ids, meta, kv_caches, lora):
        # In a captured decode step the rows past the batch are padding, at position 0, where no real
        # decode token sits (eager steps have no padding): they are not counted as routed.
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        mask = meta.positions > 0 if capturing else None
        for moe in self.moe_layers:
            moe.count_mask = mask
        return super().forward(input_ids, meta, kv_caches, lora)

    def kernel_key(self, num_tokens: int) -> int | None:
        """What the fused-MoE kernels of a step of `num_tokens` tokens compile per (engine/warmup.py)."""
        if not self.moe_layers:
            return None
        moe = self.moe_layers[0]
        return block_rows(num_tokens * moe.spec.top_k, moe.experts.num_local)

    def load_weights(self, tensors, source: str) -> None:
        fp8 = self.ctx.fp8
        if fp8 is not None and fp8.scheme != ON_THE_FLY:  # an FP8 checkpoint: its experts dequantized
            modules = dict(self.named_modules())
            dtype_of = partial(self._dequantized_dtype, modules=modules)
            tensors = dequantize_experts(list(tensors), dtype_of, self.ctx.device)
        super().load_weights(tensors, source)

    def _dequantized_dtype(self, name: str, modules: dict) -> torch.dtype | None:
        """The dtype a float8 checkpoint tensor is dequantized to: the model dtype for the routed experts'
        weights, the router's own (GLM-4.5's is float32) for its weight; None for any other tensor."""
        owner, _, param = self.map_name(name)[0].rpartition(".")
        module = modules.get(owner)
        if isinstance(module, Experts):
            return self.ctx.dtype if param in ("gate_up_proj", "down_proj") else None
        moe = modules.get(owner.rpartition(".")[0])
        if param == "weight" and isinstance(moe, SparseMoE) and module is moe.gate:
            return module.weight.dtype
        return None

    def rename(self, name: str) -> str:
        """A checkpoint name in this family's older spelling -> the transformers 5 one."""
        return name

    def map_name(self, name: str) -> tuple[str, int | tuple | None]:
        name = self.rename(name)
        match = _PER_EXPERT.match(name)
        if match is not None:
            part = self.expert_part_names.get(match["part"], match["part"])
            if part in EXPERT_PARTS:
                target = "gate_up_proj" if part != "down_proj" else "down_proj"
                return f"{match['prefix']}.{target}", (int(match["expert"]), EXPERT_PARTS[part])
        return super().map_name(name)

    def checkpoint_name(self, param: str, part) -> str:
        if isinstance(part, tuple):
            expert, which = part
            name = "down_proj" if which is None else ("gate_proj", "up_proj")[which]
            prefix = param.rsplit(".", 1)[0]
            return f"{prefix}.{expert}.{name}.weight"
        return super().checkpoint_name(param, part)


class RoutingCounts:
    """Tokens routed to each expert of each MoE layer since the start, for metrics (the router runs on
    every rank, so rank 0's counts cover every token). `read()` never waits for the GPU: it returns the
    counts copied at the previous call (one step behind at most) and starts the next copy."""

    def __init__(self, layers: list, device: torch.device):
        num_experts = layers[0].spec.num_experts if layers else 0
        self.counts = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)
        for i, moe in enumerate(layers):
            moe.routed_tokens = self.counts[i]
        pinned = device.type == "cuda"
        self._host = torch.zeros(self.counts.shape, dtype=torch.int64, pin_memory=pinned)

    def read(self) -> torch.Tensor:  # [moe layers, E] int64 on the CPU
        snapshot = self._host.clone()
        self._host.copy_(self.counts, non_blocking=True)
        return snapshot if self.counts.device.type == "cuda" else self._host.clone()
