"""Chained prefix-cache hashes of full KV blocks, keyed by the adapter and the cache salt as well as the tokens.

A block's hash covers its parent's hash, so equal hashes mean equal whole prefixes, not just equal
blocks. The adapter id goes into every block: the same tokens under two adapters (or under an
adapter and the base model) have different K/V, and sharing them would be both a correctness bug
and a leak between tenants.

The cache salt (vLLM's `cache_salt`) seeds the chain: a request's first block hangs off a root
derived from its salt, so every block of a salted request differs from every block of a request
with another salt or none, and two requests share K/V only if their salts are equal. The server
salts every request with its tenant (or the tenant's cache group), so tenants never share blocks
and `cached_tokens` cannot tell one tenant what another sent. No salt (the offline engine) keeps
the unsalted root: every unsalted request shares with every other.

    root(salt) -> h0 = H(root, block 0, adapter) -> h1 = H(h0, block 1, adapter) -> ...
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent of an unsalted request's first block; a fixed digest, so first blocks chain like any other.
ROOT_BLOCK_HASH = hashlib.sha256(b"loraserve/kv-block-root").digest()

# Adapter tags: None must differ from every string, the empty string included.
_BASE_MODEL_TAG = b"\x00"
_ADAPTER_TAG = b"\x01"


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], adapter_id: str | None) -> bytes:
    """sha256 over (parent hash, token count, token ids as int64, adapter tag [+ utf-8 id]).

    The parent has a fixed length and the token count is explicit, so the adapter bytes that end
    the message can never be confused with token bytes.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    if adapter_id is None:
        digest.update(_BASE_MODEL_TAG)
    else:
        digest.update(_ADAPTER_TAG)
        digest.update(adapter_id.encode("utf-8"))
    return digest.digest()


def root_block_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: ROOT_BLOCK_HASH without a salt, else a digest of the salt.

    The salted message is longer than the unsalted one and holds the salt after a fixed prefix, so no
    salt (the empty string included) gives the unsalted root and two salts never give the same one.
    """
    if cache_salt is None:
        return ROOT_BLOCK_HASH
    return hashlib.sha256(b"loraserve/kv-block-root\x00salt:" + cache_salt.encode("utf-8")).digest()


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    adapter_id: str | None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Append the hashes of blocks that became full since the last call; returns `block_hashes`.

    Tokens of a request only ever grow at the end, so earlier hashes stay valid and each block is
    hashed once over the request's life instead of once per step. `cache_salt` seeds the first block
    (see root_block_hash); later blocks inherit it through their parents.
    """
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else root_block_hash(cache_salt)
        block_tokens = token_ids[index * block_size : (index + 1) * block_size]
        block_hashes.append(hash_block_tokens(parent, block_tokens, adapter_id))
    return block_hashes
