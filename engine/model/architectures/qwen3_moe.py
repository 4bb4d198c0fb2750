"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) with a mixture of
experts in every layer but those `mlp_only_layers` and `decoder_sparse_step` leave dense; the top-k
weights are renormalized when `norm_topk_prob`. No shared expert."""

from __future__ import annotations

from dataclasses import replace

from engine.model.layers.moe import MoESpec
from engine.model.layers.moe_model import MoEDecoderModel


class Qwen3MoeModel(MoEDecoderModel):
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def attention_spec(self, config, layer, rope):
        return replace(super().attention_spec(config, layer, rope), qk_norm_eps=config.rms_norm_eps)

    @classmethod
    def is_moe_layer(cls, config, layer: int) -> bool:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return (
            layer not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer + 1) % step == 0
        )

    def moe_spec(self, config) -> MoESpec:
        return MoESpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            activation=config.hidden_act,
        )
