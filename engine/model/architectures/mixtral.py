"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of experts in every layer, top-k weights
always renormalized. Hub checkpoints name the block `block_sparse_moe` and an expert's gate, down and up
projections w1, w2 and w3; transformers 5 names them as Qwen3-MoE does (`mlp.experts.gate_up_proj`)."""

from __future__ import annotations

from engine.model.layers.moe import MoESpec
from engine.model.layers.moe_model import MoEDecoderModel


class MixtralModel(MoEDecoderModel):
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    expert_part_names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    @classmethod
    def check_config(cls, config) -> None:
        # Jitter noise only perturbs training; at inference transformers ignores it too.
        if getattr(config, "num_local_experts", 0) < 1:
            raise ValueError("Mixtral config has no experts (num_local_experts)")

    def rename(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def moe_spec(self, config) -> MoESpec:
        return MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            activation=config.hidden_act,
        )
