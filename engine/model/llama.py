"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, with per-token LoRA.

q/k/v and gate/up run as fused projections; LoRA adds each adapter's low-rank update to the
fused output through `LoRAContext.apply`, one slot index per token. A projection is a plain weight in
the model dtype or an `Fp8Linear` (FP8 base weights); LoRA runs in the model dtype on top of either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.lora.context import LoRAContext
from engine.lora.slots import FUSED_PROJECTIONS
from engine.model import fused_ops
from engine.model.attention import AttentionMetadata, attention, write_kv
from engine.model.fp8_linear import Fp8Linear, linear
from engine.model.rope import RotaryEmbedding

QKV, GATE_UP = FUSED_PROJECTIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | Fp8Linear  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    o: torch.Tensor | Fp8Linear  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | Fp8Linear  # [2 * intermediate, hidden]
    down: torch.Tensor | Fp8Linear  # [hidden, intermediate]
    # fp8 KV cache scales (stored * scale = real); 1.0 unless the checkpoint has them. Unused otherwise.
    k_scale: torch.Tensor  # [1] float32
    v_scale: torch.Tensor  # [1] float32


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    kv_scales_from_checkpoint: bool = False  # True: the checkpoint carried k_scale/v_scale tensors
    quantization: str | None = None  # the FP8 scheme of the projections (fp8_checkpoint.py); None: none


class LlamaModel:
    """Forward pass only; weights are plain tensors owned by this object."""

    def __init__(self, config, weights: ModelWeights, max_positions: int, attention_backend: str = "torch"):
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = config
        self.weights = weights
        self.attention_backend = attention_backend  # "torch" or "triton"
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.sliding_windows = _sliding_windows(config)
        embed = weights.embed
        self.rope = RotaryEmbedding(config, self.head_dim, max_positions, embed.device, embed.dtype)
        # The Triton path runs norms, residual adds, RoPE and SiLU-and-mul as one kernel each (fused_ops).
        self.fused = attention_backend == "triton" and fused_ops.supports_fused_rope(self.head_dim)

    @property
    def num_layers(self) -> int:
        return len(self.weights.layers)

    @property
    def vocab_size(self) -> int:
        return self.weights.embed.shape[0]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: key, value caches
        lora: LoRAContext | None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.embed(input_ids)
        if self.fused:
            return self._forward_fused(hidden, meta, kv_caches, lora)
        for i, layer in enumerate(self.weights.layers):
            residual = hidden
            x = _rms_norm(hidden, layer.input_norm, self.eps)
            hidden = residual + self._attention(i, layer, x, meta, kv_caches[i], lora)
            residual = hidden
            x = _rms_norm(hidden, layer.post_norm, self.eps)
            hidden = residual + self._mlp(i, layer, x, lora)
        return _rms_norm(hidden, self.weights.norm, self.eps)

    def _forward_fused(self, residual, meta, kv_caches, lora) -> torch.Tensor:
        """`forward` with each residual add folded into the norm after it (residual updated in place)."""
        layers = self.weights.layers
        x = fused_ops.rms_norm(residual, layers[0].input_norm, self.eps)
        for i, layer in enumerate(layers):
            out = self._attention(i, layer, x, meta, kv_caches[i], lora)
            x = fused_ops.rms_norm(out, layer.post_norm, self.eps, residual)
            out = self._mlp(i, layer, x, lora)
            following = layers[i + 1].input_norm if i + 1 < len(layers) else self.weights.norm
            x = fused_ops.rms_norm(out, following, self.eps, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        return F.embedding(input_ids, self.weights.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return F.linear(hidden, self.weights.lm_head).float()

    def _attention(self, i, layer, x, meta, kv_cache, lora):
        qkv = linear(x, layer.qkv, layer.qkv_bias)
        if lora is not None:
            lora.apply(qkv, x, i, QKV)
        if self.fused:
            fused_ops.apply_rope_(
                qkv,
                meta.positions,
                self.rope.cos,
                self.rope.sin,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if not self.fused:
            q, k = self.rope(meta.positions, q, k)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping, layer.k_scale, layer.v_scale)
        attn = attention(
            q,
            key_cache,
            value_cache,
            meta,
            self.scale,
            self.sliding_windows[i],
            self.attention_backend,
            layer.k_scale,
            layer.v_scale,
        )
        attn = attn.reshape(-1, self.q_size)
        out = linear(attn, layer.o)
        if lora is not None:
            lora.apply(out, attn, i, ("o_proj",))
        return out

    def _mlp(self, i, layer, x, lora):
        gate_up = linear(x, layer.gate_up)
        if lora is not None:
            lora.apply(gate_up, x, i, GATE_UP)
        if self.fused:
            act = fused_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = linear(act, layer.down)
        if lora is not None:
            lora.apply(out, act, i, ("down_proj",))
        return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, scale in the model dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _sliding_windows(config) -> list[int | None]:
    """Per layer: the attention window, or None for full attention (Mistral, Qwen2's sliding layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return [None] * config.num_hidden_layers
    return [window] * config.num_hidden_layers
