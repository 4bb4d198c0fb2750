"""Random paged-attention batches and a float64 reference, shared by the attention tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.model.kv_quant import dequantize_fp8, quantize_fp8


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: list[int]
    query_lens: list[int]

    @property
    def query_start_loc(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    def device_meta(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_lens [num_seqs] int32, query_start_loc [num_seqs + 1] int32)."""
        return torch.tensor(self.seq_lens, dtype=torch.int32), torch.tensor(
            self.query_start_loc, dtype=torch.int32
        )


def make_batch(
    seqs: list[tuple[int, int]],  # per sequence: (cached tokens, new tokens)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> PagedBatch:
    """Sequences scattered over a shuffled block pool, with spare blocks full of noise."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(blocks_needed) + 1, dtype=torch.long)
    used = 0
    for i, b in enumerate(blocks_needed):
        tables[i, :b] = order[used : used + b]
        used += b
    num_tokens = sum(n for _, n in seqs)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return PagedBatch(
        q=rand(num_tokens, num_heads, head_dim),
        key_cache=rand(num_blocks, block_size, num_kv_heads, head_dim),
        value_cache=rand(num_blocks, block_size, num_kv_heads, head_dim),
        block_tables=tables,
        seq_lens=[c + n for c, n in seqs],
        query_lens=[n for _, n in seqs],
    )


def reference_attention(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: each head's sink logit joins the softmax (gpt-oss)
) -> torch.Tensor:
    """float64 softmax attention, one sequence and one head at a time (scores soft-capped if asked)."""
    bs = batch.key_cache.shape[1]
    num_heads, num_kv_heads = batch.q.shape[1], batch.key_cache.shape[2]
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    starts = batch.query_start_loc
    for i, seq_len in enumerate(batch.seq_lens):
        slots = [int(batch.block_tables[i, p // bs]) * bs + p % bs for p in range(seq_len)]
        k = batch.key_cache.flatten(0, 1)[slots].double()  # [seq_len, num_kv_heads, head_dim]
        v = batch.value_cache.flatten(0, 1)[slots].double()
        q_len = batch.query_lens[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            keys = torch.arange(seq_len)
            allowed = keys <= pos
            if sliding_window is not None:
                allowed &= keys > pos - sliding_window
            for h in range(num_heads):
                kv = h // (num_heads // num_kv_heads)
                scores = (k[:, kv] @ batch.q[starts[i] + j, h].double()) * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                scores[~allowed] = float("-inf")
                if sinks is not None:  # a key of logit sinks[h] whose value is zero
                    probs = torch.softmax(torch.cat([scores, sinks[h : h + 1].double()]), 0)[:-1]
                else:
                    probs = torch.softmax(scores, 0)
                out[starts[i] + j, h] = probs @ v[:, kv]
    return out


def quantize_batch(batch: PagedBatch, k_scale: float, v_scale: float):
    """(the batch with float8 e4m3 caches, the same batch with those caches dequantized to q's dtype,
    k_scale [1], v_scale [1]): the reference for an fp8 read is the reference on the dequantized K/V."""
    ks, vs = torch.tensor([k_scale]), torch.tensor([v_scale])
    kq, vq = quantize_fp8(batch.key_cache, ks), quantize_fp8(batch.value_cache, vs)
    fp8 = dataclasses.replace(batch, key_cache=kq, value_cache=vq)
    dequantized = dataclasses.replace(
        batch,
        key_cache=dequantize_fp8(kq, ks, batch.q.dtype),
        value_cache=dequantize_fp8(vq, vs, batch.q.dtype),
    )
    return fp8, dequantized, ks, vs
