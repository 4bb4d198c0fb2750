"""The base model's projection sizes: what an adapter's tensors must fit."""

from __future__ import annotations

from dataclasses import dataclass

# The seven linear projections of a Llama-family decoder layer that LoRA may target.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama-family model, read from its Hugging Face config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
        )

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        dims = {
            "q_proj": (self.hidden_size, q_size),
            "k_proj": (self.hidden_size, kv_size),
            "v_proj": (self.hidden_size, kv_size),
            "o_proj": (q_size, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in dims:
            raise ValueError(f"unknown projection {module!r}; supported: {', '.join(TARGET_MODULES)}")
        return dims[module]


def module_key(layer: int, module: str) -> str:
    """A projection's name among the base model's modules, as PEFT matches config patterns against it
    (`model.layers.3.self_attn.q_proj`)."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"
