"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a mixture of experts in every layer, attention with q/k/v/o
biases and a learned sink logit per head (`self_attn.sinks`), alternating sliding-window and full layers
(`layer_types`), YaRN RoPE; a router with a bias whose top-k logits are softmaxed, experts with biases and
a clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit).

Its checkpoint's expert layout differs from Qwen3-MoE's, and is converted as it loads:
    mlp.router.weight / .bias                  -> mlp.gate.weight / .bias
    mlp.experts.gate_up_proj       [E, H, 2I]  gate and up *interleaved* along 2I (gate 2j, up 2j + 1)
                                               -> [E, 2I, H], gate rows then up rows
    mlp.experts.gate_up_proj_bias  [E, 2I]     interleaved -> gate then up
    mlp.experts.down_proj          [E, I, H]   -> [E, H, I]
    mlp.experts.down_proj_bias     [E, H]
The hub's checkpoints are MXFP4 (`quantization_config.quant_method: "mxfp4"`): the experts' weights come
as `gate_up_proj_blocks`/`_scales` (rows [E, 2I] of H) and `down_proj_blocks`/`_scales` (rows [E, H] of
I), dequantized to the model dtype at load (engine/model/mxfp4.py).

PEFT's expert LoRA (`target_parameters`) on gate_up_proj keeps the interleaving in lora_B's rows
(ModelShape.gate_up_interleaved tells the adapter reader to reorder them).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.model.layers.moe import MoESpec
from engine.model.layers.moe_model import MoEDecoderModel
from engine.model.mxfp4 import Mxfp4Tensor

_EXPERTS = ".mlp.experts."


class GptOssModel(MoEDecoderModel):
    architectures = ("GptOssForCausalLM",)
    model_types = ("gpt_oss",)
    gate_up_interleaved = True
    dequantized_methods = ("mxfp4",)

    @classmethod
    def check_config(cls, config) -> None:
        if getattr(config, "num_local_experts", 0) < 1:
            raise ValueError("gpt-oss config has no experts (num_local_experts)")
        kinds = set(getattr(config, "layer_types", None) or ())
        if kinds - {"sliding_attention", "full_attention"}:
            raise ValueError(
                f"gpt-oss layer_types {sorted(kinds)}: only sliding_attention and full_attention are served"
            )
        if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
            raise ValueError("gpt-oss config has sliding_attention layers but no sliding_window")

    def attention_spec(self, config, layer, rope):
        return replace(super().attention_spec(config, layer, rope), sinks=True)

    def moe_spec(self, config) -> MoESpec:
        alpha, limit = (getattr(config, name, None) for name in ("swiglu_alpha", "swiglu_limit"))
        return MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,  # a softmax over the top-k logits: the top-k probabilities renormalized
            activation="clamped_swiglu",
            router_bias=True,
            expert_bias=True,
            # Configs written before transformers' GptOssConfig had these fields (the reference hard-codes
            # alpha 1.702): MoESpec's defaults, the reference values, instead of refusing the model.
            swiglu_alpha=MoESpec.swiglu_alpha if alpha is None else float(alpha),
            swiglu_limit=MoESpec.swiglu_limit if limit is None else float(limit),
        )

    def rename(self, name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def load_weights(self, tensors, source: str) -> None:
        tensors = list(tensors)
        quantized = {t.name: t for t in tensors if t.name.endswith(("_blocks", "_scales"))}
        ready = [_to_engine_layout(t) for t in tensors if t.name not in quantized]
        for name in quantized:
            base, kind = name.rsplit("_", 1)
            partner = f"{base}_{'scales' if kind == 'blocks' else 'blocks'}"
            if partner not in quantized:
                raise ValueError(
                    f"checkpoint {source} has {name!r} but not {partner!r} (an MXFP4 weight needs both)"
                )
            if kind == "blocks":
                weight = Mxfp4Tensor(base, quantized[name], quantized[partner], self.ctx.dtype)
                ready.append(_mxfp4_layout(weight))
        super().load_weights(ready, source)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate/up alternating along `dim` (gate 2j, up 2j + 1) -> every gate, then every up."""
    size = t.shape[dim]
    gate, up = (torch.arange(first, size, 2, device=t.device) for first in (0, 1))
    return torch.cat([t.index_select(dim, gate), t.index_select(dim, up)], dim)


class _Converted:
    """A checkpoint tensor read through a conversion of whole experts (its leading rows), lazily."""

    def __init__(self, source, shape: tuple[int, ...], convert):
        self.name, self._source, self.shape, self._convert = source.name, source, shape, convert
        self.is_float8 = source.is_float8

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self._convert(self._source.rows(start, end))

    def read(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])


def _to_engine_layout(tensor):
    """transformers' gpt-oss expert tensors -> the MoE layer's (engine/model/layers/moe.py)."""
    name, shape = tensor.name, tuple(tensor.shape)
    if _EXPERTS not in name:
        return tensor
    kind = name.rsplit(".", 1)[-1]
    if kind == "gate_up_proj" and len(shape) == 3:
        e, h, two_i = shape  # [E, H, 2I] interleaved -> [E, 2I, H], gate rows then up rows
        return _Converted(tensor, (e, two_i, h), lambda t: _deinterleave(t.transpose(1, 2), 1).contiguous())
    if kind == "gate_up_proj_bias" and len(shape) == 2:
        return _Converted(tensor, shape, lambda t: _deinterleave(t, 1))
    if kind == "down_proj" and len(shape) == 3:
        e, i, h = shape  # [E, I, H] -> [E, H, I]
        return _Converted(tensor, (e, h, i), lambda t: t.transpose(1, 2).contiguous())
    return tensor


def _mxfp4_layout(weight):
    """A dequantized MXFP4 expert weight, stored rows first ([E, out, in], the engine's layout): gate_up's
    rows still alternate gate and up."""
    if weight.name.endswith(".gate_up_proj"):
        return _Converted(weight, weight.shape, lambda t: _deinterleave(t, 1))
    return weight
