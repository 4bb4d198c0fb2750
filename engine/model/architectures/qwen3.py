"""Qwen3 (dense): Llama's layer with a per-head RMSNorm on q and on k before RoPE, no biases."""

from __future__ import annotations

from dataclasses import replace

from engine.model.layers.decoder import DecoderModel


class Qwen3Model(DecoderModel):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    def attention_spec(self, config, layer, rope):
        spec = super().attention_spec(config, layer, rope)
        return replace(spec, qk_norm_eps=config.rms_norm_eps)
