"""The KV events on the wire: vLLM's `KVEventBatch` of `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.

Each ZeroMQ message has three frames: the topic, an 8-byte big-endian sequence number (0, 1, 2, ... per
publisher) and the msgpack payload, one batch per engine step that changed the prefix cache. The batch
is always positional; the events inside it are positional arrays tagged by their class name first
("array", vLLM's encoding before vLLM #42892) or maps with the tag under "type" ("map", since then):

    batch:        [ts, [event, ...], data_parallel_rank]
    BlockStored:  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                   medium, lora_name]
    BlockRemoved: ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared: ["AllBlocksCleared"]

Field order and names follow vLLM's schema; vLLM's later optional fields (`extra_keys`, `group_idx`, ...)
are left out, so old decoders that read a fixed number of fields keep working. A block hash travels as
vLLM sends it by default: the low 64 bits of the digest (its last 8 bytes, big-endian) as an unsigned
integer. `token_ids` holds the tokens of every stored block, `block_size` per block, in order.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the tier these blocks live in


def external_hash(digest: bytes) -> int:
    """A block hash as published: the digest's last 8 bytes, big-endian (vLLM's int form)."""
    return int.from_bytes(digest[-8:], "big")


def _event_types(array_like: bool) -> tuple[type, type, type]:
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        """One change to the prefix cache; its tag is the class name."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None  # the block before the first one here; None for a prompt's first
        token_ids: list[int]  # len(block_hashes) * block_size tokens
        block_size: int
        lora_id: int | None  # engine.lora.router_names.lora_int_id of the adapter version; None: base model
        medium: str | None
        lora_name: str | None  # the tenant-qualified adapter name routers route by; None: base model

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was published
    events: list[Any]
    data_parallel_rank: int | None = None  # this engine's rank; always 0 (no data parallelism in one engine)


# encoding -> (BlockStored, BlockRemoved, AllBlocksCleared)
EVENT_TYPES = {"array": _event_types(array_like=True), "map": _event_types(array_like=False)}
