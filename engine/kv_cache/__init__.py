"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and per-request block tables over it."""

from engine.kv_cache.block_hash import (
    ROOT_BLOCK_HASH,
    extend_block_hashes,
    hash_block_tokens,
    root_block_hash,
)
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.kv_cache_manager import KVCacheManager

__all__ = [
    "ROOT_BLOCK_HASH",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "extend_block_hashes",
    "hash_block_tokens",
    "root_block_hash",
]
