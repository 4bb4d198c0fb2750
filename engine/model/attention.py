"""Paged attention: K/V live in fixed-size blocks read through block tables.

`attention` dispatches to the plain-torch path (`paged_attention`, which runs everywhere and is the
reference) or to the Triton kernels (paged_attention_triton.py, the CUDA path). Both read an fp8 cache
(float8 e4m3 with per-layer K and V scales, kv_quant.py) as well as one in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from engine.model.kv_quant import dequantize_fp8, is_fp8, quantize_fp8
from engine.model.paged_attention_triton import paged_attention_triton


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to, for one step.

    Example: two sequences, block_size 4; seq 0 is decoding its 6th token (5 cached), seq 1 prefills
    3 prompt tokens. Tokens are laid out seq by seq:
        positions       = [5, 0, 1, 2]
        query_start_loc = [0, 1, 4]          # seq i's new tokens are [start[i], start[i+1])
        seq_lens        = [6, 3]             # cached + new tokens, per sequence
        block_tables    = [[7, 2], [4, 0]]   # padded with 0; only ceil(seq_len/4) entries are read
        slot_mapping    = [2*4+1, 4*4+0, 4*4+1, 4*4+2]   # block_id * block_size + offset
    """

    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64
    query_start_loc: list[int]  # [num_seqs + 1], host side
    seq_lens: list[int]  # [num_seqs], host side
    # Device copies for the Triton kernels; built from the host lists on first use when not given
    # (CUDA-graph steps pass static buffers here instead).
    seq_lens_tensor: torch.Tensor | None = None  # [num_seqs] int32
    query_start_loc_tensor: torch.Tensor | None = None  # [num_seqs + 1] int32

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @cached_property  # read by every layer's attention: once a step
    def max_query_len(self) -> int:
        starts = self.query_start_loc
        return max((b - a for a, b in zip(starts, starts[1:])), default=0)

    def device_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_lens [num_seqs], query_start_loc [num_seqs + 1]) as int32 tensors on the step's device."""
        device = self.positions.device
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int32).to(
                device, non_blocking=True
            )
        if self.query_start_loc_tensor is None:
            starts = torch.tensor(self.query_start_loc, dtype=torch.int32)
            self.query_start_loc_tensor = starts.to(device, non_blocking=True)
        return self.seq_lens_tensor, self.query_start_loc_tensor


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
    k_scale: torch.Tensor | None = None,  # [1] float32; used only by an fp8 cache
    v_scale: torch.Tensor | None = None,  # [1] float32
) -> None:
    """Store the step's new K/V; done for the whole batch before any sequence reads the cache.

    An fp8 cache gets K/V divided by their scales and saturated (kv_quant.quantize_fp8); the copy goes
    through uint8 views since index_copy_ has no float8 kernel on the CPU.
    """
    if is_fp8(key_cache):
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 KV cache needs k_scale and v_scale")
        k = quantize_fp8(k, k_scale).view(torch.uint8)
        v = quantize_fp8(v, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,  # [1] float32; fp8 caches only
    v_scale: torch.Tensor | None = None,  # [1] float32
    softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits (gpt-oss)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    An fp8 cache is dequantized (`.float() * scale`, then the model dtype) per sequence before the
    softmax, which runs in the model dtype as for any other cache. With `softcap` the scores are capped
    before the mask, as transformers' eager attention does (its SDPA path has no soft-capping). With
    `sinks` each head's sink logit joins the softmax's denominator (a key whose value is zero).
    """
    block_size = key_cache.shape[1]
    fp8 = is_fp8(key_cache)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        blocks = meta.block_tables[i, : -(-seq_len // block_size)]
        k = key_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
        v = value_cache[blocks].flatten(0, 1)[:seq_len]
        if fp8:
            k, v = dequantize_fp8(k, k_scale, q.dtype), dequantize_fp8(v, v_scale, q.dtype)
        q_positions = meta.positions[start:end]
        k_positions = torch.arange(seq_len, device=q.device)
        allowed = k_positions[None, :] <= q_positions[:, None]  # [num_new, seq_len]
        if sliding_window is not None:
            allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
        if softcap is None and sinks is None:
            attn = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),  # [num_heads, num_new, head_dim]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=allowed,
                scale=scale,
                enable_gqa=True,
            )
        else:
            attn = _eager_attention(q[start:end], k, v, allowed, scale, softcap, sinks)
        out[start:end] = attn.transpose(0, 1)
    return out


def _eager_attention(
    q: torch.Tensor,  # [num_new, num_heads, head_dim]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    allowed: torch.Tensor,  # [num_new, seq_len] bool
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [num_heads] float32
) -> torch.Tensor:  # [num_heads, num_new, head_dim]
    """transformers' eager attention with soft-capping (Gemma 2) or sinks (gpt-oss), op for op (scores
    and probabilities rounded to the model dtype where it rounds them), except that the softmax always
    runs in float32: gpt-oss's runs in the model dtype there, which only float32 models match exactly."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [num_heads, num_new, seq_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # the sink: one more logit per head, dropped after the softmax
        sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
        probs = probs[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


def attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    backend: str,  # "torch" or "triton" (resolved by EngineConfig.resolved_attention_backend)
    k_scale: torch.Tensor | None = None,  # [1] float32; fp8 caches only
    v_scale: torch.Tensor | None = None,  # [1] float32
    softcap: float | None = None,  # attention logit soft-capping (Gemma 2)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]: the result goes here if given
    sinks: torch.Tensor | None = None,  # [num_heads] float32 attention sink logits (gpt-oss)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if backend == "torch":
        result = paged_attention(
            q, key_cache, value_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks
        )
        return result if out is None else out.copy_(result)
    if backend != "triton":
        raise ValueError(f"attention backend must be 'torch' or 'triton', got {backend!r}")
    seq_lens, query_start_loc = meta.device_tensors()
    return paged_attention_triton(
        q,
        key_cache,
        value_cache,
        meta.block_tables[: meta.num_seqs],
        seq_lens,
        query_start_loc,
        meta.max_query_len,
        scale,
        sliding_window,
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
        softcap=softcap,
        sinks=sinks,
    )
