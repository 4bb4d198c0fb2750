"""The attention block: fused q/k/v projection, optional q/k RMSNorm, RoPE, paged attention (optionally
sliding-window and soft-capped), output projection; tensor-parallel by heads.

Per layer it takes what varies between architectures and between one model's layers: q/k/v biases
(Qwen2), q/k norms (per head: Qwen3, Gemma 3; over all heads: OLMoE), the softmax scale (Gemma's
query_pre_attn_scalar), the soft cap (Gemma 2), the sliding window (Mistral; Gemma's local layers), the
RoPE table (Gemma 3's local layers rotate at another base) and attention sinks (gpt-oss:
`self_attn.sinks`, one logit per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model import fused_ops
from engine.model.attention import AttentionMetadata, attention, write_kv
from engine.model.kv_quant import default_scale
from engine.model.layers.context import BuildContext
from engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear, check_shape, new_param
from engine.model.layers.norm import RMSNorm
from engine.model.layers.sharding import Split
from engine.model.layers.whole_qk_norm import WholeHeadsRMSNorm, norm_q_and_k
from engine.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as its architecture configures it."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RotaryEmbedding
    scale: float  # softmax scale: head_dim ** -0.5 unless the architecture says otherwise
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # that norm over all heads at once instead (OLMoE: whole_qk_norm.py)
    norm_offset: bool = False  # Gemma's (1 + weight) norms
    sliding_window: int | None = None
    softcap: float | None = None  # attention logit soft-capping (Gemma 2)
    sinks: bool = False  # a learned logit per head in every softmax's denominator, with no value (gpt-oss)


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, ctx: BuildContext):
        super().__init__()
        tp = ctx.tp
        self.spec = spec
        heads = Split(spec.num_heads, spec.head_dim)
        kv_heads = Split(spec.num_kv_heads, spec.head_dim, replicate=True)
        self.num_heads = heads.units_per_rank(tp.world_size)  # this rank's
        self.num_kv_heads = kv_heads.units_per_rank(tp.world_size)
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size, [heads, kv_heads, kv_heads], ctx, spec.qkv_bias
        )
        self.o_proj = RowParallelLinear(heads, spec.hidden_size, ctx, spec.o_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm_eps is not None and spec.qk_norm_whole:
            self.q_norm = WholeHeadsRMSNorm(heads, spec.qk_norm_eps, ctx)
            self.k_norm = WholeHeadsRMSNorm(kv_heads, spec.qk_norm_eps, ctx)
        elif spec.qk_norm_eps is not None:
            self.q_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, ctx, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, ctx, spec.norm_offset)
        # fp8 KV cache scales (stored * scale = real); 1.0 unless the checkpoint has them.
        self.k_scale = nn.Parameter(default_scale(ctx.device), requires_grad=False)
        self.v_scale = nn.Parameter(default_scale(ctx.device), requires_grad=False)
        for param in (self.k_scale, self.v_scale):
            param.weight_loader, param.required, param.loaded = self._load_kv_scale, set(), set()
        self.sinks = None  # [num_heads] float32, this rank's heads' sink logits (self_attn.sinks)
        if spec.sinks:
            self.sinks = new_param((self.num_heads,), torch.float32, ctx.device, self._load_sinks)
            self._head_range = heads.range(tp.rank, tp.world_size)
        self.backend = ctx.attention_backend
        # The fused q/k norm kernel rotates whole heads: with a partial rotary width, the torch ops
        # (and for norms over all heads, which it does not compute).
        self.fused = ctx.fused and (
            self.q_norm is None or (spec.rope.rotary_dim == spec.head_dim and not spec.qk_norm_whole)
        )
        self._qk_weight: torch.Tensor | None = None  # [2, head_dim], q_norm's and k_norm's (fused path)

    def finish_loading(self) -> None:
        if self.fused and self.q_norm is not None:
            self._qk_weight = torch.stack([self.q_norm.weight.data, self.k_norm.weight.data]).contiguous()

    def project(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        meta: AttentionMetadata,  # only its token-level tensors are read: positions, slot_mapping
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora,
    ) -> torch.Tensor:  # [tokens, num_heads, head_dim] queries, RoPE applied
        """Everything before the attention kernel: q/k/v projection, q/k norms, RoPE, and the K/V write
        into the cache. Token by token (no per-sequence metadata), so piecewise CUDA graphs capture it."""
        spec, rope = self.spec, self.spec.rope
        qkv = self.qkv_proj(x, lora)
        if self.fused:
            if self.q_norm is not None:
                fused_ops.head_norm_rope_(
                    qkv,
                    meta.positions,
                    rope.cos,
                    rope.sin,
                    self._qk_weight,
                    self.q_norm.eps,
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    spec.norm_offset,
                )
            else:
                fused_ops.apply_rope_(
                    qkv, meta.positions, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, self.head_dim
                )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if not self.fused:
            if self.spec.qk_norm_whole:
                q, k = norm_q_and_k(self.q_norm, self.k_norm, q, k)
            elif self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope(meta.positions, q, k)
        key_cache, value_cache = kv_cache
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        return q

    def attend(
        self,
        q: torch.Tensor,  # [tokens, num_heads, head_dim]
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor | None = None,  # [tokens, num_heads, head_dim]: written in place when given
    ) -> torch.Tensor:  # [tokens, num_heads, head_dim]
        """The attention kernel over the paged cache (K/V already written by `project`)."""
        spec = self.spec
        key_cache, value_cache = kv_cache
        return attention(
            q,
            key_cache,
            value_cache,
            meta,
            spec.scale,
            spec.sliding_window,
            self.backend,
            self.k_scale,
            self.v_scale,
            spec.softcap,
            out,
            self.sinks,
        )

    def _load_sinks(self, param, tensor, shard) -> None:
        check_shape(tensor, (self.spec.num_heads,))
        start, end = (i // self.head_dim for i in self._head_range)
        param.data.copy_(tensor.read()[start:end].float())
        param.loaded.add(None)

    def _load_kv_scale(self, param, tensor, shard) -> None:
        """One positive number per layer (per-tensor), the same on every rank."""
        scale = tensor.read().float()
        if scale.numel() != 1 or not torch.isfinite(scale).all() or scale.item() <= 0:
            raise ValueError(
                f"{tensor.name}: the KV cache scale must be one positive number (per-tensor), "
                f"got shape {tuple(scale.shape)}"
            )
        param.data.copy_(scale.reshape(1))
        param.loaded.add(None)
