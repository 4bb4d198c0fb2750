"""The decoder layer and the model every architecture is: embedding, layers, final norm, LM head.

An architecture (engine/model/architectures/) is a `DecoderModel` subclass that says what differs:
its names (`architectures`, `model_types`), how its checkpoint packs projections
(`packed_modules_mapping`), its norms (`norm_offset`, `sandwich_norms`), and per layer its attention
(`attention_spec`) and MLP (`build_mlp`). Everything else, loading included, is here.

Module paths are the checkpoint's names (`model.layers.3.self_attn.qkv_proj.weight`), so loading is:
for each checkpoint tensor, map its name through `packed_modules_mapping` (q_proj -> part 0 of
qkv_proj) and hand it to that parameter's own weight loader, which reads this rank's shard.

    hidden = embed(ids)                                   residual = None
    per layer: x, residual = input_norm(hidden, residual)  (the add folded into the norm)
               a = attention(x)                            [sandwich: a = post_attention_norm(a)]
               x, residual = pre_mlp_norm(a, residual)
               hidden = mlp(x)                             [sandwich: hidden = post_feedforward_norm(hidden)]
    hidden, _ = norm(hidden, residual); logits = lm_head(hidden)

Under tensor parallelism with the fused all-reduce (engine/parallel/fused_allreduce.py), `attention`
and `mlp` return their partial sums and the norm after each all-reduces them, fused with its residual
add (DecoderLayer.defer_reductions).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from engine.model import fused_ops
from engine.model.fp8_checkpoint import DROPPED_NAMES
from engine.model.layers.attention import Attention, AttentionSpec
from engine.model.layers.context import BuildContext
from engine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.layers.linear import ParallelLinear
from engine.model.layers.mlp import GatedMLP
from engine.model.layers.norm import RMSNorm
from engine.model.rope import RotaryEmbedding, rotary_dim

# fp8 KV-cache scales under `model.layers.N.self_attn.`, as vLLM reads them, first found wins: llm-compressor's
# and vLLM's own names, ModelOpt's, AutoFP8's output scales of k_proj/v_proj, and the older single kv_scale.
KV_SCALE_NAMES = {
    "k_scale": ("k_scale", "attn.k_scale", "k_proj.k_scale", "k_proj.output_scale", "kv_scale"),
    "v_scale": ("v_scale", "attn.v_scale", "v_proj.v_scale", "v_proj.output_scale", "kv_scale"),
}
# The linear projections of a decoder layer, by module name (each a LoRA target unless packed).
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecoderLayer(nn.Module):
    def __init__(
        self, attention: Attention, mlp: nn.Module, hidden_size: int, eps: float, ctx, offset, sandwich
    ):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.sandwich = sandwich
        self.input_layernorm = RMSNorm(hidden_size, eps, ctx, offset)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, ctx, offset)
        if sandwich:  # Gemma 2/3: post_attention_layernorm normalises the attention output itself
            self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, ctx, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, ctx, offset)

    def defer_reductions(self) -> None:
        """Under tensor parallelism with the fused all-reduce: the attention's o_proj and the MLP hand
        their partial sums to the norm after them (post_attention_layernorm; the next layer's
        input_layernorm or the final norm), which all-reduces them with its residual add. Not with
        sandwich norms, whose post-norms normalise the layer's output alone."""
        if self.sandwich:
            return
        self.self_attn.o_proj.defer_reduce = True
        mlp = getattr(self.mlp, "down_proj", self.mlp)  # GatedMLP's last projection, or a MoE block
        if hasattr(mlp, "defer_reduce"):
            mlp.defer_reduce = True

    def forward(self, hidden, residual, meta, kv_cache, lora) -> tuple[torch.Tensor, torch.Tensor]:
        q, residual = self.attention_input(hidden, residual, meta, kv_cache, lora)
        out = self.self_attn.attend(q, meta, kv_cache)
        return self.attention_output(out.reshape(-1, self.self_attn.q_size), residual, lora)

    def attention_input(self, hidden, residual, meta, kv_cache, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [tokens, heads, head_dim], residual): the input norm and the attention's `project`
        (its K/V written to the cache). `hidden`: [tokens, hidden], or under the fused all-reduce the previous
        layer's MLP partial sums (PartialSums). `residual` None: the layer's input is the residual stream."""
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.project(x, meta, kv_cache, lora), residual

    def attention_output(self, attn, residual, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) from the attention kernel's output `attn` [tokens, num_heads * head_dim]:
        o_proj, the norms and the MLP."""
        out = self.self_attn.o_proj(attn, lora)
        if self.sandwich:
            out = self.post_attention_layernorm(out)
            x, residual = self.pre_feedforward_layernorm(out, residual)
            return self.post_feedforward_layernorm(self.mlp(x, lora)), residual
        x, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(x, lora), residual


class DecoderModel(nn.Module):
    """Forward pass over the paged KV cache with per-token LoRA; built on one rank's shard."""

    architectures: tuple[str, ...] = ()  # config.architectures[0] values served by this class
    model_types: tuple[str, ...] = ()  # config.model_type values (when `architectures` is absent)
    # Fused module -> the checkpoint's (and PEFT's) names of its parts, in column order. A checkpoint
    # that stores the fused module itself (Phi-3) maps nothing: its qkv_proj is one LoRA target.
    packed_modules_mapping: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    norm_offset = False  # Gemma's RMSNorm scales by (1 + weight)
    sandwich_norms = False  # Gemma 2/3: norms after attention and after the MLP as well
    # The experts' PEFT lora_B rows of gate_up_proj alternate gate and up (gpt-oss; ModelShape's).
    gate_up_interleaved = False
    # quantization_config methods this class dequantizes itself at load (gpt-oss: "mxfp4").
    dequantized_methods: tuple[str, ...] = ()

    @classmethod
    def lora_targets(cls, config=None) -> tuple[str, ...]:
        """The projections LoRA may target, in slot-table order (adapter_format.ModelShape.targets);
        `config` where the set depends on it (a mixture of experts with dense layers)."""
        return tuple(m for name in LINEAR_NAMES for m in cls.packed_modules_mapping.get(name, (name,)))

    @classmethod
    def dense_layers(cls, config) -> tuple[int, ...]:
        """A mixture of experts' layers whose MLP is dense (ModelShape.dense_layers); none here."""
        return ()

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse settings this class does not implement (ValueError naming them)."""

    # -- per-architecture hooks ------------------------------------------------------------------------

    def layer_type(self, config, layer: int) -> str:
        """ "sliding_attention" (local) or "full_attention" (global)."""
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return layer_types[layer]
        return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"

    def rope_layer_type(self, config, layer: int) -> str | None:
        """The key of this layer's RoPE settings where they differ per layer type (Gemma 3); else None."""
        return None

    def attention_spec(self, config, layer: int, rope: RotaryEmbedding) -> AttentionSpec:
        local = self.layer_type(config, layer) == "sliding_attention"
        head_dim = self.head_dim
        return AttentionSpec(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=self.total_kv_heads,
            head_dim=head_dim,
            rope=rope,
            scale=head_dim**-0.5,
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            sliding_window=getattr(config, "sliding_window", None) if local else None,
        )

    def build_mlp(self, config, layer: int, ctx: BuildContext) -> nn.Module:
        activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            activation,
            ctx,
            bool(getattr(config, "mlp_bias", False)),
        )

    def embedding_scale(self, config) -> float | None:
        return None

    def final_logit_softcap(self, config) -> float | None:
        return None

    # -- construction ----------------------------------------------------------------------------------

    def __init__(self, config, ctx: BuildContext):
        super().__init__()
        self.check_config(config)
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        # The Triton path runs norms, residual adds, RoPE and act-and-mul as one kernel each (fused_ops).
        fused = ctx.attention_backend == "triton" and fused_ops.supports_fused_rope(
            rotary_dim(config, self.head_dim)
        )
        ctx = replace(ctx, fused=fused)
        self.ctx = ctx
        ropes: dict[str | None, RotaryEmbedding] = {}
        layers = []
        for i in range(config.num_hidden_layers):
            key = self.rope_layer_type(config, i)
            if key not in ropes:
                ropes[key] = RotaryEmbedding(
                    config, self.head_dim, ctx.max_positions, ctx.device, ctx.dtype, key
                )
            attention = Attention(self.attention_spec(config, i, ropes[key]), ctx)
            layer = DecoderLayer(
                attention,
                self.build_mlp(config, i, ctx),
                config.hidden_size,
                config.rms_norm_eps,
                ctx,
                self.norm_offset,
                self.sandwich_norms,
            )
            layers.append(layer)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, ctx, self.embedding_scale(config)
        )
        self.model.layers = nn.ModuleList(layers)
        if ctx.fused and ctx.tp.fuses_add_norm:  # the fused kernel rounds as the Triton norm does
            for layer in layers:
                layer.defer_reductions()
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, self.norm_offset)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            self.model.embed_tokens, ctx, self.tied, self.final_logit_softcap(config)
        )
        targets = self.lora_targets(config)
        for name, module in self.named_modules():
            if isinstance(module, ParallelLinear):
                short = name.rsplit(".", 1)[-1]
                modules = self.packed_modules_mapping.get(short, (short,))
                module.name = name
                module.layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
                module.lora_modules = modules if all(m in targets for m in modules) else ()
        self.kv_scales_from_checkpoint = False
        self.quantization = None if ctx.fp8 is None else ctx.fp8.scheme

    # -- what the model runner reads -------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def attention_backend(self) -> str:
        return self.ctx.attention_backend

    @property
    def fused(self) -> bool:
        """Whether the Triton path's fused element-wise kernels run (norms, RoPE, act-and-mul)."""
        return self.ctx.fused

    @property
    def num_heads(self) -> int:  # this rank's
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads(self) -> int:  # this rank's
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        meta,  # AttentionMetadata
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: key, value caches
        lora,  # LoRAContext | None
    ) -> torch.Tensor:  # [num_tokens, hidden]
        # The layers' own forward (attention_input, attend, attention_output): the same ops in the same
        # order as the pieces below, with a plain loop, since eager steps are host-bound.
        own = lora.own_embedding if lora is not None and lora.vocab else None
        hidden = self.model.embed_tokens(input_ids, own)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, meta, kv_cache, lora)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    # -- the pieces (engine/piecewise_graphs.py captures them; `forward` runs the same layer methods) --

    def first_piece(self, input_ids, meta, kv_caches, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding .. layer 0's queries (K/V written): (queries [tokens, heads, head_dim], residual)."""
        own = lora.own_embedding if lora is not None and lora.vocab else None
        hidden = self.model.embed_tokens(input_ids, own)
        return self.model.layers[0].attention_input(hidden, None, meta, kv_caches[0], lora)

    def attend(self, layer: int, q, meta, kv_caches, out=None) -> torch.Tensor:
        """Layer `layer`'s attention kernel: [tokens, heads, head_dim] (into `out` when given)."""
        return self.model.layers[layer].self_attn.attend(q, meta, kv_caches[layer], out)

    def piece(self, index: int, attn, residual, meta, kv_caches, lora):
        """Piece `index` (1 .. num_layers): layer index-1's attention output `attn` [tokens, heads *
        head_dim] through its o_proj and MLP, then layer index's queries and (queries, residual); the last
        piece ends at the final norm instead and returns (hidden [tokens, hidden], None)."""
        hidden, residual = self.model.layers[index - 1].attention_output(attn, residual, lora)
        if index == self.num_layers:
            hidden, _ = self.model.norm(hidden, residual)
            return hidden, None
        return self.model.layers[index].attention_input(hidden, residual, meta, kv_caches[index], lora)

    def compute_logits(self, hidden: torch.Tensor, own_heads=None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32; `own_heads`: adapters' own heads (LoRAContext.own_heads)."""
        return self.lm_head(hidden, own_heads)

    # -- loading ---------------------------------------------------------------------------------------

    def map_name(self, name: str) -> tuple[str, int | None]:
        """(parameter name, part) a checkpoint tensor fills."""
        name = name.replace(".weight_scale_inv", ".weight_scale")
        for fused, parts in self.packed_modules_mapping.items():
            for part, sub in enumerate(parts):
                if f".{sub}." in name:
                    return name.replace(f".{sub}.", f".{fused}."), part
        return name, None

    def checkpoint_name(self, param: str, part: int | None) -> str:
        """The checkpoint tensor a parameter's part comes from (for messages)."""
        for fused, parts in self.packed_modules_mapping.items():
            if part is not None and f".{fused}." in param:
                return param.replace(f".{fused}.", f".{parts[part]}.")
        return param

    def load_weights(self, tensors: Iterable, source: str) -> None:
        """Fill every parameter from the checkpoint's tensors (CheckpointTensor: read lazily, by shard)."""
        tensors = list(tensors)
        params = dict(self.named_parameters())
        if self.ctx.fp8 is None:
            self._refuse_unlabelled_float8(tensors, params, source)
        unused, kv_scales = [], {}
        for tensor in tensors:
            name = tensor.name
            if name.endswith("rotary_emb.inv_freq") or name.endswith(tuple(f".{n}" for n in DROPPED_NAMES)):
                continue
            if name == "lm_head.weight" and self.tied:
                continue
            scale_targets = _kv_scale_targets(name)
            for target, rank in scale_targets:
                if target not in kv_scales or rank < kv_scales[target][0]:
                    kv_scales[target] = (rank, tensor)
            if scale_targets:
                continue
            target, part = self.map_name(name)
            if target not in params:
                unused.append(name)
                continue
            param = params[target]
            param.weight_loader(param, tensor, part)
        for target, (_, tensor) in kv_scales.items():
            if target not in params:
                unused.append(tensor.name)
                continue
            params[target].weight_loader(params[target], tensor, None)
        lm_head = self.lm_head.weight
        if lm_head is not None and not lm_head.loaded:
            self.lm_head.tie()  # no lm_head.weight: the embedding serves as the head (as before)
            params.pop("lm_head.weight")
        for param_name, param in params.items():
            missing = sorted(param.required - param.loaded, key=lambda p: -1 if p is None else p)
            if missing:
                name = self.checkpoint_name(param_name, missing[0])
                scale = (
                    " (or weight_scale_inv: a float8 weight needs its scale)"
                    if name.endswith("_scale")
                    else ""
                )
                raise ValueError(f"checkpoint {source} lacks tensor {name!r}{scale}")
        if unused:
            raise ValueError(f"checkpoint {source} has tensors this model does not use: {sorted(unused)[:5]}")
        self.kv_scales_from_checkpoint = bool(kv_scales)
        for module in self.modules():
            if module is not self and hasattr(module, "finish_loading"):
                module.finish_loading()

    @torch.no_grad()
    def fill_dummy_weights(self, seed: int = 0) -> None:
        """vLLM's load_format="dummy": weights drawn on the device (std 0.02), norms at their identity (1, or
        0 for Gemma's 1 + w), KV scales 1; FP8 projections quantize their draws. Nothing is read."""
        gen = torch.Generator(device=self.ctx.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, ParallelLinear):
                module.fill_dummy(gen)
        for name, param in self.named_parameters():
            if (
                param.dtype.is_floating_point
                and param.dtype.itemsize > 1
                and not param.loaded
                and param.required
            ):
                if name.endswith("norm.weight"):
                    param.data.fill_(0.0 if self.norm_offset else 1.0)
                else:
                    param.data.normal_(0.0, 0.02, generator=gen)
            param.loaded |= param.required
        for module in self.modules():
            if module is not self and hasattr(module, "finish_loading"):
                module.finish_loading()

    def _refuse_unlabelled_float8(self, tensors, params, source: str) -> None:
        """A float8 tensor with no quantization_config to say how to read it: the first in model order."""
        order = {name: i for i, name in enumerate(params)}
        float8 = [t.name for t in tensors if t.is_float8]
        if float8:
            first = min(
                float8, key=lambda n: (order.get(self.map_name(n)[0], len(order)), self.map_name(n)[1] or 0)
            )
            raise ValueError(
                f"checkpoint {source} stores {first!r} as float8 but config.json's quantization_config does "
                "not describe it (only the linear projections of a supported FP8 format are read)"
            )


def _kv_scale_targets(name: str) -> list[tuple[str, int]]:
    """(the attention's k_scale or v_scale parameter, priority) a KV-cache scale tensor may fill (both for
    the single kv_scale); empty for any other tensor."""
    prefix, sep, rest = name.partition(".self_attn.")
    if not sep:
        return []
    return [
        (f"{prefix}.self_attn.{p}", names.index(rest)) for p, names in KV_SCALE_NAMES.items() if rest in names
    ]
