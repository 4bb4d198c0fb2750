"""Gemma 3 (text): Gemma 2's layer with a (1 + w) RMSNorm on q and on k, five local layers to one global
by default (config.layer_types), and RoPE per layer type: local layers at rope_local_base_freq (10,000),
global ones at rope_theta (1,000,000, linearly scaled in the larger models)."""

from __future__ import annotations

from dataclasses import replace

from engine.model.architectures.gemma2 import Gemma2Model
from engine.model.rope import per_layer_rope


class Gemma3Model(Gemma2Model):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)

    @classmethod
    def check_config(cls, config) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention (an embedding model) is not a causal LM; not served"
            )

    def rope_layer_type(self, config, layer: int) -> str | None:
        return self.layer_type(config, layer) if per_layer_rope(config) else None

    def attention_spec(self, config, layer, rope):
        return replace(super().attention_spec(config, layer, rope), qk_norm_eps=config.rms_norm_eps)
