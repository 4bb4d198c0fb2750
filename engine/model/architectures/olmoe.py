"""OLMoE (OLMoE-1B-7B): Llama's attention with RMSNorms of q and k over all heads at once (not per head:
engine/model/layers/whole_qk_norm.py), then a mixture of experts in every layer, top-k weights
renormalized only with `norm_topk_prob` (off in the released checkpoints), no shared expert. LoRA
targets as Qwen3-MoE's. `clip_qkv` (clamping q, k and v) is not implemented: refused."""

from __future__ import annotations

from dataclasses import replace

from engine.model.layers.moe import MoESpec
from engine.model.layers.moe_model import MoEDecoderModel


class OlmoeModel(MoEDecoderModel):
    architectures = ("OlmoeForCausalLM",)
    model_types = ("olmoe",)

    @classmethod
    def check_config(cls, config) -> None:
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(
                f"OLMoE config sets clip_qkv={config.clip_qkv}: clamping q, k and v is not served "
                "(the released OLMoE checkpoints leave it null)"
            )
        # transformers sizes q_norm by hidden_size: it spans every head only when heads divide it.
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"OLMoE config: hidden_size {config.hidden_size} must be a multiple of num_attention_heads "
                f"{config.num_attention_heads} (q_norm spans hidden_size)"
            )

    def attention_spec(self, config, layer, rope):
        spec = super().attention_spec(config, layer, rope)
        return replace(spec, qk_norm_eps=config.rms_norm_eps, qk_norm_whole=True)

    def moe_spec(self, config) -> MoESpec:
        return MoESpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            activation=config.hidden_act,
        )
