"""Rotary position embeddings, with the `rope_scaling` variants a checkpoint's config declares.

The inverse frequencies come from transformers' own RoPE init functions, so every variant matches
the reference implementation exactly; cos/sin are precomputed once for all positions.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Variants whose frequencies do not depend on the sequence length, so one table serves all positions.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> dict:
    """The config's RoPE settings in one dict (transformers 5 `rope_parameters`, or 4.x `rope_scaling`)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class RotaryEmbedding:
    """cos/sin tables [max_positions, head_dim] and their application to q and k."""

    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device, dtype: torch.dtype):
        params = rope_parameters(config)
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq, attention_scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_scaling).to(device=device, dtype=dtype)

    def __call__(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
