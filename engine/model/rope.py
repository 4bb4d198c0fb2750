"""Rotary position embeddings, with the `rope_scaling` variants a checkpoint's config declares.

The inverse frequencies come from transformers' own RoPE init functions, so every variant matches
the reference implementation exactly; cos/sin are precomputed once for all positions. A model whose
layers differ (Gemma 3: local layers at base 10,000, global ones at 1,000,000 with linear scaling) keeps
one table per layer type. Only the first `rotary_dim` dims of a head rotate (`partial_rotary_factor`,
Phi-4-mini's 0.75); the rest pass through.

LongRoPE (Phi-3's `longrope`, formerly `su`): transformers rotates a sequence longer than
`original_max_position_embeddings` with the long factors and a shorter one with the short factors,
recomputing the whole sequence when it crosses over. A paged KV cache cannot re-rotate cached keys, so,
as vLLM does, the factors are chosen once from the context the engine serves: long when `max_model_len`
exceeds `original_max_position_embeddings`, short otherwise. Sequences then match transformers exactly
when max_model_len fits the original length, and when it does not, every sequence longer than the
original length; shorter ones are rotated with the long factors that transformers keeps for long ones.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Variants whose frequencies do not depend on the sequence length, so one table serves all positions.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's RoPE settings in one dict (transformers 5 `rope_parameters`, or 4.x `rope_scaling`);
    for models with settings per layer type (Gemma 3), those of `layer_type`."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    return params


def per_layer_rope(config) -> bool:
    """True when the config keeps RoPE settings per layer type (`rope_parameters[layer_type]`)."""
    params = getattr(config, "rope_parameters", None) or {}
    return any(isinstance(v, dict) for v in params.values())


def rotary_dim(config, head_dim: int, layer_type: str | None = None) -> int:
    factor = rope_parameters(config, layer_type).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", 1.0)
    return int(head_dim * factor)


class RotaryEmbedding:
    """cos/sin tables [max_positions, rotary_dim] and their application to q and k."""

    def __init__(
        self,
        config,
        head_dim: int,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        layer_type: str | None = None,
    ):
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(config, head_dim, layer_type)
        kwargs = {"layer_type": layer_type} if layer_type is not None and per_layer_rope(config) else {}
        positions = torch.arange(max_positions, dtype=torch.float32)
        if rope_type == "default":
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            inv_freq, attention_scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
            freqs = torch.outer(positions, inv_freq.float())  # [max_positions, rotary_dim / 2]
        elif rope_type == "longrope":
            original = (
                params.get("original_max_position_embeddings") or config.original_max_position_embeddings
            )
            seq_len = max_positions if max_positions > original else None  # None: the short factors
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
                config, "cpu", seq_len=seq_len, **kwargs
            )
            freqs = torch.outer(positions, inv_freq.float())
        else:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
            freqs = torch.outer(positions, inv_freq.float())
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
        if self.rotary_dim == self.head_dim:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        r = self.rotary_dim
        return (
            torch.cat((q[..., :r] * cos + _rotate_half(q[..., :r]) * sin, q[..., r:]), dim=-1),
            torch.cat((k[..., :r] * cos + _rotate_half(k[..., :r]) * sin, k[..., r:]), dim=-1),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
