"""Gemma 2: alternating local (sliding-window) and global layers, attention logits soft-capped in the
attention kernel, final logits soft-capped, embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and
after both attention and MLP, GeGLU, and a softmax scale of query_pre_attn_scalar ** -0.5."""

from __future__ import annotations

from dataclasses import replace

from engine.model.layers.decoder import DecoderModel


class Gemma2Model(DecoderModel):
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    norm_offset = True
    sandwich_norms = True

    def attention_spec(self, config, layer, rope):
        spec = super().attention_spec(config, layer, rope)
        return replace(
            spec,
            scale=config.query_pre_attn_scalar**-0.5,
            softcap=getattr(config, "attn_logit_softcapping", None),
            norm_offset=True,
        )

    def embedding_scale(self, config) -> float:
        return config.hidden_size**0.5

    def final_logit_softcap(self, config) -> float | None:
        return getattr(config, "final_logit_softcapping", None)
