"""The base model's projection sizes, and which projections LoRA may target: what an adapter must fit.

Projections are named as in the checkpoint (and so as PEFT names them): Llama-family layers have
separate `q_proj`, `k_proj`, `v_proj` and `gate_proj`, `up_proj`; Phi-3 stores them fused as `qkv_proj`
and `gate_up_proj`, which is where PEFT puts its LoRA pairs. Each architecture names its own target set
(`ModelShape.targets`); the engine's model registry fills it in (engine/model/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# Projections under `self_attn` and under `mlp` (the module path PEFT's alpha_pattern keys see).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
# A mixture of experts' stacked expert weights ([E, 2I, H] and [E, H, I]), which PEFT adapts with
# target_parameters: one low-rank pair per expert (adapter_format/expert_lora.py).
EXPERT_MODULES = ("experts.gate_up_proj", "experts.down_proj")
# A shared expert beside the routed ones (Qwen2-MoE's `mlp.shared_expert`): a gated MLP of
# `shared_expert_intermediate_size`, adapted as a dense MLP is (PEFT's target_modules).
SHARED_EXPERT_MODULES = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
# GLM-4.5's (and DeepSeek's) `mlp.shared_experts`: n_shared_experts experts fused into one gated MLP of
# `moe_intermediate_size * n_shared_experts` (no shared_expert_gate), adapted the same way under its own name.
SHARED_EXPERTS_MODULES = ("shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj")
# Gates that pick or weigh experts: PEFT's all-linear wraps them, LoRA on them is not served.
EXPERT_GATES = ("gate", "shared_expert_gate")
# The seven linear projections of a Llama-family decoder layer: the default target set.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What a fused projection stands for: a hint when an adapter names the other form.
FUSED_FORMS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder model (from its Hugging Face config) and the projections LoRA may target."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # In slot-table order (engine/lora/slots.py); a subset of ATTENTION_MODULES + MLP_MODULES
    # (+ EXPERT_MODULES for a mixture of experts).
    targets: tuple[str, ...] = TARGET_MODULES
    architecture: str | None = None  # e.g. "Phi3ForCausalLM", for messages
    num_experts: int = 0  # routed experts of a mixture of experts (0: dense)
    moe_intermediate_size: int = 0  # of one expert
    # The base vocabulary (rows of embed_tokens and lm_head) and whether the LM head is the embedding
    # (tie_word_embeddings): what an adapter's own embedding or head must fit (vocab_modules.py).
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    shared_expert_intermediate_size: int = 0  # of a mixture of experts' shared expert (0: none)
    # gpt-oss: the stacked experts' gate_up_proj alternates gate and up outputs (gate 2j, up 2j + 1), so
    # PEFT's expert lora_B rows do too; the engine holds gate rows then up rows (expert_lora.expert_pair).
    gate_up_interleaved: bool = False
    # A mixture of experts' layers whose MLP is a dense gated MLP of intermediate_size (GLM-4.5's first
    # first_k_dense_replace, Qwen3-MoE's mlp_only_layers): there, and only there, gate_proj, up_proj and
    # down_proj are targets; the experts and shared experts are targets of the other layers only.
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        known = ATTENTION_MODULES + MLP_MODULES + (EXPERT_MODULES if self.num_experts else ())
        known += (
            SHARED_EXPERT_MODULES + SHARED_EXPERTS_MODULES if self.shared_expert_intermediate_size else ()
        )
        unknown = [t for t in self.targets if t not in known]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {list(self.targets)} must be distinct known projections")

    @classmethod
    def from_hf_config(cls, config, targets: tuple[str, ...] = TARGET_MODULES) -> ModelShape:
        """Sizes from a config; `targets` and the architecture come from the engine's model registry
        (`engine.model_shape`), which callers that know the model should use instead."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        architectures = getattr(config, "architectures", None) or [None]
        num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            targets=tuple(targets),
            architecture=architectures[0],
            num_experts=num_experts,
            moe_intermediate_size=(
                getattr(config, "moe_intermediate_size", None) or config.intermediate_size
                if num_experts
                else 0
            ),
            vocab_size=getattr(config, "vocab_size", 0) or 0,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            shared_expert_intermediate_size=shared_expert_size(config) if num_experts else 0,
        )

    @property
    def model_name(self) -> str:
        return self.architecture or "the base model"

    def block(self, module: str) -> str:
        """The module path segment PEFT puts the projection under: `self_attn` or `mlp`."""
        return "self_attn" if module in ATTENTION_MODULES else "mlp"

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection LoRA may target."""
        if module not in self.targets:
            raise ValueError(
                f"{module!r} is not a LoRA target of {self.model_name}; supported: {', '.join(self.targets)}"
            )
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, q_size),
            "k_proj": (h, kv_size),
            "v_proj": (h, kv_size),
            "qkv_proj": (h, q_size + 2 * kv_size),
            "o_proj": (q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h),
            "experts.gate_up_proj": (h, 2 * self.moe_intermediate_size),
            "experts.down_proj": (self.moe_intermediate_size, h),
            "shared_expert.gate_proj": (h, self.shared_expert_intermediate_size),
            "shared_expert.up_proj": (h, self.shared_expert_intermediate_size),
            "shared_expert.down_proj": (self.shared_expert_intermediate_size, h),
        }[as_shared_expert(module)]

    def layer_refusal(self, layer: int, module: str) -> str | None:
        """Why `module` of `layer` has no projection to adapt in a mixture of experts with dense layers
        (a dense MLP's gate_proj on an MoE layer, an expert on a dense one); None where it has one."""
        if not self.num_experts or module in ATTENTION_MODULES:
            return None
        dense = layer in self.dense_layers
        if dense == (module in MLP_MODULES):
            return None
        dense_list = ", ".join(map(str, self.dense_layers)) or "none"
        if dense:
            return (
                f"layer {layer} of {self.model_name} has a dense MLP (gate_proj, up_proj, down_proj), not "
                f"mlp.{module}: was the adapter trained on another model?"
            )
        return (
            f"layer {layer} of {self.model_name} is a mixture of experts, with no dense mlp.{module} (the "
            f"dense MLPs are in layers {dense_list}): was the adapter trained on another model?"
        )

    def module_experts(self, module: str) -> int:
        """Low-rank pairs per layer of a projection: one per expert of the stacked expert weights, else 1."""
        return self.num_experts if module in EXPERT_MODULES else 1

    def unsupported_targets_hint(self, modules: list[str]) -> str:
        """Why an adapter that names `modules` (none of them targets here) does not fit, for messages."""
        gates = [m for m in modules if m in EXPERT_GATES]
        if gates and self.num_experts:
            return (
                f"; mlp.{gates[0]} weighs or picks the experts and takes no LoRA: train the adapter with "
                "target_modules naming the projections (not all-linear) or exclude_modules naming it"
            )
        for fused, parts in FUSED_FORMS.items():
            named = [m for m in modules if m in parts]
            if named and fused in self.targets:
                return (
                    f"; {self.model_name} stores {', '.join(parts)} fused as {fused}: train the adapter on "
                    f"this model (PEFT then targets {fused})"
                )
            if fused in modules and set(parts) <= set(self.targets):
                return (
                    f"; {self.model_name} has separate {', '.join(parts)} where this adapter targets {fused} "
                    "(an adapter trained on another architecture?)"
                )
        return ""


def as_shared_expert(module: str) -> str:
    """GLM-4.5's `shared_experts.X` under Qwen2-MoE's name `shared_expert.X`, the one key of their sizes
    and splits (both are a gated MLP of shared_expert_intermediate_size); any other module as it is."""
    plural = "shared_experts."
    return "shared_expert." + module[len(plural) :] if module.startswith(plural) else module


def shared_expert_size(config) -> int:
    """The shared expert's intermediate size: Qwen2-MoE's own setting, or GLM-4.5's (DeepSeek's)
    n_shared_experts experts of moe_intermediate_size each, run as one MLP; 0 without one."""
    own = getattr(config, "shared_expert_intermediate_size", 0) or 0
    shared = getattr(config, "n_shared_experts", 0) or 0
    return own or shared * (getattr(config, "moe_intermediate_size", 0) or 0)


def module_key(layer: int, module: str) -> str:
    """A projection's name among the base model's modules, as PEFT matches config patterns against it
    (`model.layers.3.self_attn.q_proj`)."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"
