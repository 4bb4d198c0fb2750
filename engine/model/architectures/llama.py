"""Llama, Mistral and Qwen2: the plain pre-norm decoder. Mistral's sliding window covers every layer;
Qwen2 adds q/k/v biases and a sliding window only on its upper layers when `use_sliding_window`."""

from __future__ import annotations

from dataclasses import replace

from engine.model.layers.decoder import DecoderModel


class LlamaModel(DecoderModel):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    model_types = ("llama", "mistral", "qwen2")

    def layer_type(self, config, layer: int) -> str:
        if config.model_type == "qwen2" and not getattr(config, "layer_types", None):
            use = getattr(config, "use_sliding_window", False) and layer >= config.max_window_layers
            return "sliding_attention" if use else "full_attention"
        return super().layer_type(config, layer)

    def attention_spec(self, config, layer, rope):
        spec = super().attention_spec(config, layer, rope)
        if config.model_type == "qwen2":  # biases on q, k and v (not o), whatever attention_bias says
            spec = replace(spec, qkv_bias=True, o_bias=False)
        return spec
