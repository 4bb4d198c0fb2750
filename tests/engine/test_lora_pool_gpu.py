"""The GPU adapter pool counts in gpu_memory_utilization (skipped without CUDA): it is allocated before
the KV cache is sized, so a larger pool leaves exactly that many bytes fewer to the KV cache.

    TRITON_INTERPRET=0 python -m pytest tests/engine/test_lora_pool_gpu.py -q
"""

from __future__ import annotations

import gc

import pytest
import torch
from factories import make_model

from engine import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_kv_blocks_shrink_by_the_bytes_the_lora_pool_grows(tmp_path):
    # Wide KV heads, so the budget (not max_num_seqs x max_model_len) bounds the cache.
    model_dir = make_model(
        tmp_path / "model",
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
    )
    common = dict(
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_seqs=1024,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        max_loras=16,
        max_lora_rank=64,
    )
    runs = {}
    for budget in (64, None):  # one rank-64 adapter's pages, then 16 of them (the default)
        runner = LLM(str(model_dir), lora_pool_rank_budget=budget, **common).engine.runner
        runs[budget] = (runner.num_kv_blocks, runner.kv_block_bytes, runner.lora_slots.num_bytes)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    (small_blocks, block_bytes, small_pool), (big_blocks, _, big_pool) = runs[64], runs[None]
    grown = big_pool - small_pool
    assert grown > 100 * block_bytes, "the test needs a pool difference of many blocks"
    lost = (small_blocks - big_blocks) * block_bytes
    assert grown - 2 * block_bytes <= lost <= grown * 1.02 + 2 * block_bytes, (
        small_blocks,
        big_blocks,
        grown,
    )
