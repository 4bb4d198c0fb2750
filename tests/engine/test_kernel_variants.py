"""Per-step values never make Triton compile a new variant, and the warm-up plan covers every variant a
step can launch: checked on the CPU by computing Triton's cache keys (kernel_variants.py) with H100 sizes."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_variants import record_variants

import lora_kernels
from adapter_format.model_shape import ModelShape
from engine import warmup
from engine.lora.pool import LoRAPool
from engine.model import fp8_quant_kernel
from engine.model import paged_attention_triton as attention
from lora_kernels import expand_kernels, shrink_kernels, tiles

H100_SMS = 132
SHAPE = ModelShape(
    num_layers=1, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=1, head_dim=64
)
# (output widths) of each LoRA launch of a layer, in warmup.lora_groups order: q/k/v, o, gate/up, down.
WIDTHS = [(256, 64, 64), (256,), (512, 512), (256,)]
NUM_SLOTS = 4
MAX_RANK = 8  # h rows of 8 floats: unpadded, h's strides would be divisible by 16 for even batches only
MAX_TOKENS = 1024


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(tiles, "num_sms", lambda device: H100_SMS)
    monkeypatch.setattr(attention, "num_sms", lambda device: H100_SMS)


def lora_keys(
    monkeypatch,
    token_counts: list[int],
    max_rank: int = MAX_RANK,
    rank_buckets: tuple[int, ...] | None = None,
) -> set:
    """Variant keys of every LoRA launch of one layer at each token count (sized to `rank_buckets`)."""
    rng = torch.Generator().manual_seed(0)
    shrink = ["_shrink_gathered_kernel", "_shrink_segmented_kernel"]
    expand = ["_expand_gathered_kernel", "_expand_segmented_kernel"]
    with (
        record_variants(monkeypatch, shrink_kernels, shrink) as keys,
        record_variants(monkeypatch, expand_kernels, expand) as expand_keys,
    ):
        pool = LoRAPool(SHAPE, NUM_SLOTS, max_rank, torch.float32, torch.device("cpu"))  # the engine's views
        groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
        for num_tokens in token_counts:
            for (_, in_features), widths, group in zip(warmup.lora_groups(SHAPE), WIDTHS, groups):
                x = torch.zeros(num_tokens, in_features)
                y = torch.zeros(num_tokens, sum(widths))
                views = [pool.layers[0][m] for m in group]
                slots = torch.randint(-1, NUM_SLOTS, (num_tokens,), generator=rng, dtype=torch.int32)
                ranks = torch.full(
                    (NUM_SLOTS,), min(max_rank, *(rank_buckets or [max_rank])), dtype=torch.int32
                )
                lora_kernels.add_lora_paged(
                    y,
                    x,
                    [v.lora_a for v in views],
                    [v.lora_b for v in views],
                    pool.page_table,
                    slots,
                    [v.scales for v in views],
                    widths,
                    ranks,
                    rank_buckets=rank_buckets,
                    backend="triton",
                )
    return set(keys) | set(expand_keys)


def test_warmup_token_counts_cover_every_lora_variant(monkeypatch, h100):
    def key(num_tokens):
        groups = warmup.lora_groups(SHAPE)
        return warmup.lora_key(num_tokens, groups, NUM_SLOTS, MAX_RANK, torch.float32, torch.device("cpu"))

    counts = warmup.eager_token_counts(MAX_TOKENS, key, first=1)
    assert 1 in counts and 129 in counts  # the gathered path, then the segmented one
    warmed = lora_keys(monkeypatch, counts)
    rng = random.Random(1)
    others = [2, 3, 15, 16, 17, 31, 33, 127, 128, 130, 255, 256, 257, MAX_TOKENS]
    others += rng.sample(range(1, MAX_TOKENS + 1), 40)
    unseen = lora_keys(monkeypatch, others) - warmed
    assert not unseen, (
        f"{len(unseen)} LoRA variants compiled after the warm-up: {sorted(k[0] for k in unseen)}"
    )


def test_warmup_token_counts_cover_every_rank_bucket_variant(monkeypatch, h100):
    """A pool for rank 64 sizes steps to (16), (64) or both (engine/lora/pool.py): the warm-up's token
    counts, run for each variant as engine/warmup.warm_up does, cover what any step of any variant
    launches (windowed launches for the two-bucket variant, plain ones for a single bucket)."""
    max_rank = 64
    pool = LoRAPool(SHAPE, NUM_SLOTS, max_rank, torch.float32, torch.device("cpu"))
    variants = pool.bucket_variants()
    assert variants == [(16,), (64,), (16, 64)]
    groups = warmup.lora_groups(SHAPE)

    def key(num_tokens):  # warm_up's: the launch configs of every bucket of every variant
        return tuple(
            warmup.lora_key(num_tokens, groups, NUM_SLOTS, rank, torch.float32, torch.device("cpu"))
            for variant in variants
            for rank in variant
        )

    counts = warmup.eager_token_counts(MAX_TOKENS, key, first=1)
    warmed = set().union(*(lora_keys(monkeypatch, counts, max_rank, v) for v in variants))
    rng = random.Random(2)
    others = [2, 3, 16, 17, 127, 128, 130, 256, 257, MAX_TOKENS, *rng.sample(range(1, MAX_TOKENS + 1), 20)]
    seen = [lora_keys(monkeypatch, others, max_rank, v) for v in variants]
    assert all(seen) and len(set().union(*seen)) > len(seen[0])  # the variants do launch different kernels
    unseen = set().union(*seen) - warmed
    assert not unseen, f"{len(unseen)} rank-bucket variants compiled after the warm-up"


def attention_keys(monkeypatch, batches: list[tuple[list[int], list[int]]], width_pad: int = 0) -> list:
    """Keys of paged_attention_triton calls; each batch is (query lengths, sequence lengths)."""
    block_size, heads, kv_heads, head_dim = 16, 4, 1, 64
    cache = torch.zeros(64, block_size, kv_heads, head_dim)
    with record_variants(monkeypatch, attention, ["paged_attention_kernel", "combine_splits_kernel"]) as keys:
        for query_lens, seq_lens in batches:
            starts = [0]
            for n in query_lens:
                starts.append(starts[-1] + n)
            width = max(-(-s // block_size) for s in seq_lens) + width_pad
            attention.paged_attention_triton(
                torch.zeros(starts[-1], heads, head_dim),
                cache,
                cache,
                torch.zeros(len(seq_lens), width, dtype=torch.long),
                torch.tensor(seq_lens, dtype=torch.int32),
                torch.tensor(starts, dtype=torch.int32),
                max(query_lens),
                0.125,
            )
    return keys


def test_attention_prefill_is_one_variant_whatever_the_batch(monkeypatch, h100):
    """Sequence counts of 1 or multiples of 16 and block-table widths of 1 used to be specialised on."""
    batches = []
    for num_seqs in (1, 2, 3, 16, 17, 32):
        query_lens = [1 + (i % 5) for i in range(num_seqs)]
        query_lens[0] = 7  # at least one prefill chunk
        for context in (0, 9, 40):
            batches.append((query_lens, [q + context for q in query_lens]))
    keys = attention_keys(monkeypatch, batches)
    assert len(keys) == len(batches)
    assert len(set(keys)) == 1


def test_attention_decode_variants_follow_key_splits_only(monkeypatch, h100):
    sizes = list(range(1, 41))
    batches = [([1] * n, [17 + i for i in range(n)]) for n in sizes]
    keys = [k for k in attention_keys(monkeypatch, batches) if k[0] == "paged_attention_kernel"]
    splits = {attention.decode_num_splits(n, 1, torch.device("cpu")) for n in sizes}
    assert len(set(keys)) == len(splits)


@pytest.mark.parametrize("group_size", [128, 384], ids=["block-scaled", "per-token"])
def test_fp8_activation_quantization_is_one_variant_whatever_the_batch(monkeypatch, group_size):
    """Block-scaled scales are laid out [groups, tokens]: their stride is the step's token count."""
    with record_variants(monkeypatch, fp8_quant_kernel, ["_quantize_rows_kernel"]) as keys:
        for num_tokens in (1, 2, 3, 16, 17, 32, 100):
            fp8_quant_kernel.quantize_activations_triton(torch.zeros(num_tokens, 384), group_size)
    assert len(keys) == 7
    assert len(set(keys)) == 1
