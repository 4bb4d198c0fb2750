"""GLM-4.5 / GLM-4.6 (and GLM-4.5-Air): Llama's attention with q/k/v biases (`attention_bias`; o_proj has
none), a per-head q/k RMSNorm when `use_qk_norm`, RoPE over the first half of each head
(`partial_rotary_factor`); dense MLPs in the first `first_k_dense_replace` layers, then mixtures of
experts with DeepSeek-V3's routing (sigmoid scores, a choice-only bias, top-k within the best
`topk_group` of `n_group` expert groups, weights renormalized with `norm_topk_prob` and scaled by
`routed_scaling_factor`) and `n_shared_experts` shared experts run as one gated MLP added to the routed
sum with no shared-expert gate (engine/model/layers/grouped_topk_moe.py). LoRA targets: attention,
the routed experts, the shared experts' gate_proj, up_proj and down_proj (PEFT's `shared_experts.gate_proj`...),
and the dense layers' MLP gate_proj, up_proj and down_proj (MoEDecoderModel.lora_targets).

The checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`, stored as `model.layers.N`
for N from num_hidden_layers on) serve speculative decoding only: they are skipped at load, as vLLM's
main model skips them; the engine does not run them."""

from __future__ import annotations

import re
from dataclasses import replace

from adapter_format.model_shape import SHARED_EXPERTS_MODULES, shared_expert_size
from engine.model.layers.grouped_topk_moe import GroupedTopK, GroupedTopKMoE
from engine.model.layers.moe import MoESpec
from engine.model.layers.moe_model import MoEDecoderModel

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeModel(MoEDecoderModel):
    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)

    shared_expert_targets = SHARED_EXPERTS_MODULES  # LoRA targets of their own (MoEDecoderModel)

    @classmethod
    def check_config(cls, config) -> None:
        experts, groups = config.n_routed_experts, config.n_group or 1
        if experts < 1 or (config.n_shared_experts or 0) < 1:
            raise ValueError(
                "GLM-4-MoE config needs routed experts (n_routed_experts) and shared experts (n_shared_experts)"
            )
        if experts % groups or (groups > 1 and experts // groups < 2):
            raise ValueError(
                f"GLM-4-MoE config: n_routed_experts ({experts}) must split into n_group ({groups}) groups of "
                "at least two experts"
            )
        if not 1 <= config.topk_group <= groups:
            raise ValueError(
                f"GLM-4-MoE config: topk_group {config.topk_group} must be 1 .. n_group ({groups})"
            )
        reachable = experts if groups == 1 else config.topk_group * (experts // groups)
        if config.num_experts_per_tok > reachable:
            raise ValueError(
                f"GLM-4-MoE config: num_experts_per_tok {config.num_experts_per_tok} exceeds the {reachable} "
                "experts of the topk_group groups a token may use"
            )

    def attention_spec(self, config, layer, rope):
        spec = super().attention_spec(config, layer, rope)
        spec = replace(spec, qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False)
        if getattr(config, "use_qk_norm", False):
            spec = replace(spec, qk_norm_eps=config.rms_norm_eps)
        return spec

    @classmethod
    def is_moe_layer(cls, config, layer: int) -> bool:
        return layer >= (config.first_k_dense_replace or 0)

    def moe_spec(self, config) -> MoESpec:
        return MoESpec(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            activation=config.hidden_act,
        )

    def build_mlp(self, config, layer, ctx):
        if not self.is_moe_layer(config, layer):
            return super().build_mlp(config, layer, ctx)  # a dense layer's MLP, of intermediate_size
        routing = GroupedTopK(config.n_group or 1, config.topk_group, float(config.routed_scaling_factor))
        return GroupedTopKMoE(
            self.moe_spec(config), routing, config.hidden_size, shared_expert_size(config), ctx
        )

    def load_weights(self, tensors, source: str) -> None:
        """Everything but the multi-token-prediction layers (model.layers.L .. L + num_nextn_predict_layers - 1);
        a layer index past those is refused as any unknown tensor is."""
        first = self.config.num_hidden_layers
        extra = range(first, first + (getattr(self.config, "num_nextn_predict_layers", 0) or 0))

        def main_model(tensor) -> bool:
            match = _LAYER.match(tensor.name)
            return match is None or int(match[1]) not in extra

        super().load_weights(filter(main_model, tensors), source)
