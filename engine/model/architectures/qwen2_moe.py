"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases per `qkv_bias`, no q/k
norm, sliding windows where `layer_types` says) with a mixture of experts in the layers Qwen3-MoE's rule
picks (`mlp_only_layers`, `decoder_sparse_step`); top-k weights renormalized only with `norm_topk_prob`
(off in the released checkpoints); and in every MoE layer a shared expert, a gated MLP of
`shared_expert_intermediate_size` weighed by sigmoid(`shared_expert_gate`) and added to the routed sum
(engine/model/layers/shared_expert.py). LoRA targets: attention, the routed experts, the shared
expert's gate_proj, up_proj and down_proj, and any dense layers' MLP (MoEDecoderModel.lora_targets)."""

from __future__ import annotations

from dataclasses import replace

from adapter_format.model_shape import SHARED_EXPERT_MODULES
from engine.model.architectures.qwen3_moe import Qwen3MoeModel
from engine.model.layers.moe_model import MoEDecoderModel
from engine.model.layers.shared_expert import SharedExpertMoE


class Qwen2MoeModel(MoEDecoderModel):
    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    # Qwen3-MoE's rules, one place: which layers are MoE, and the router's settings.
    is_moe_layer = Qwen3MoeModel.is_moe_layer
    moe_spec = Qwen3MoeModel.moe_spec
    shared_expert_targets = SHARED_EXPERT_MODULES  # LoRA targets of their own (MoEDecoderModel)

    @classmethod
    def check_config(cls, config) -> None:
        if (getattr(config, "shared_expert_intermediate_size", 0) or 0) < 1:
            raise ValueError(
                "Qwen2-MoE config has no shared expert (shared_expert_intermediate_size "
                f"{getattr(config, 'shared_expert_intermediate_size', None)}): every Qwen2-MoE checkpoint has one, "
                "and a block without it is not served"
            )

    def attention_spec(self, config, layer, rope):
        spec = super().attention_spec(config, layer, rope)
        return replace(spec, qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)

    def build_mlp(self, config, layer, ctx):
        if not self.is_moe_layer(config, layer):
            return super().build_mlp(config, layer, ctx)  # a dense layer's MLP, of intermediate_size
        return SharedExpertMoE(
            self.moe_spec(config), config.hidden_size, config.shared_expert_intermediate_size, ctx
        )
