"""Phi-3 and Phi-4: a Llama-style layer whose checkpoint stores q/k/v fused as qkv_proj and gate/up as
gate_up_proj, so LoRA targets those (PEFT's names for them); LongRoPE (`longrope`/`su`) and a partial
rotary width (Phi-4-mini) come from the config (engine/model/rope.py)."""

from __future__ import annotations

from engine.model.layers.decoder import DecoderModel


class Phi3Model(DecoderModel):
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    packed_modules_mapping = {}  # the checkpoint already fuses them
