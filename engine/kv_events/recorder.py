"""Collects the prefix cache's changes of one engine step as vLLM's KV events, in the order they happened.

The KV cache calls it where blocks enter and leave the prefix-cache map (engine/kv_cache/): a run of
full blocks registered under their hashes (`stored`), one hash evicted or forgotten (`removed`;
consecutive removals share one event), every hash forgotten at once (`cleared`). The engine takes the
step's events (`take`) and publishes them as one batch. So the stream replays the map exactly: the set
of published hashes stored and not removed since the last clear is the set the pool holds.

The hashes are the pool's own (chained sha256 over the parent, the tokens, the adapter and the tenant's
salt; engine/kv_cache/block_hash.py), published as vLLM does, as the low 64 bits. A router cannot
recompute them, nor needs to: it keys its index on its own hash of (`token_ids`, `lora_name`) and uses
ours only to match a later `BlockRemoved` and a child's `parent_block_hash` (docs/OPERATIONS.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_events.wire import EVENT_TYPES, MEDIUM_GPU, external_hash
from engine.lora.router_names import lora_int_id, router_name


class KVEventRecorder:
    def __init__(self, block_size: int, encoding: str = "array") -> None:
        self.block_size = block_size
        self._stored, self._removed, self._cleared = EVENT_TYPES[encoding]
        self._events: list = []

    def stored(
        self,
        block_hashes: Sequence[bytes],
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        adapter_id: str | None,
    ) -> None:
        """Consecutive full blocks of one request were registered: `token_ids` are theirs, in order."""
        if len(token_ids) != len(block_hashes) * self.block_size:
            raise ValueError(
                f"{len(block_hashes)} blocks of {self.block_size} tokens cannot hold {len(token_ids)} tokens"
            )
        self._events.append(
            self._stored(
                block_hashes=[external_hash(h) for h in block_hashes],
                parent_block_hash=None if parent_hash is None else external_hash(parent_hash),
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None if adapter_id is None else lora_int_id(adapter_id),
                medium=MEDIUM_GPU,
                lora_name=None if adapter_id is None else router_name(adapter_id),
            )
        )

    def removed(self, block_hash: bytes) -> None:
        """A block's hash left the prefix cache (its block was reused, or its K/V was never written)."""
        last = self._events[-1] if self._events else None
        if isinstance(last, self._removed):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._events.append(self._removed(block_hashes=[external_hash(block_hash)], medium=MEDIUM_GPU))

    def cleared(self) -> None:
        """Every hash was forgotten (the prefix cache was reset)."""
        self._events.append(self._cleared())

    def take(self) -> list:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
