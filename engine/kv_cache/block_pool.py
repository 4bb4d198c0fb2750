"""The pool of KV blocks: ref counts, the free queue in eviction order, and the prefix-cache map.

Free blocks may also be lent to the adapter KV tier (engine/lora/kv_tier.py): they stay in the free queue,
counted as free, tagged with their owner (a cached adapter) instead of a prefix hash. Whoever pops one
(a request's allocation, or another lend) takes it at once, and the owner loses its whole copy
(`on_reclaim`); so the tier never makes a request wait for blocks, and the free queue stays one LRU
over idle memory: prefix-cached blocks and cached adapters age together, the least recently used goes
first (docs/ARCHITECTURE.md, "Idle KV blocks as an adapter tier").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_events import KVEventRecorder


@dataclass(eq=False)
class KVBlock:
    """One block of `block_size` token slots in every layer's K/V cache tensors.

    Identity matters, not value (eq=False): the pool hands out these very objects and takes them back.
    """

    block_id: int  # index into the cache tensors' block dimension, in [0, num_blocks)
    ref_cnt: int = 0  # requests whose block table holds this block; 0 means it sits in the free queue
    # Set while the block is full and registered in the prefix cache; a free block keeps it until
    # the block is handed out again, which is what lets a finished request's prefix be hit later.
    block_hash: bytes | None = None
    # Set while the block is free and lent to a cached adapter (engine/lora/kv_tier.py): its bytes hold
    # part of that adapter. Never set together with block_hash.
    owner: object = None
    # The event after the last adapter copy into or out of this block still queued on the copy stream
    # (engine/lora/kv_tier.py); kept through reclaims and drops until a request's allocation takes the
    # block, which first makes the compute stream wait for it (`BlockPool.wait_for_copy`).
    pending_copy: object = None


class BlockPool:
    """Blocks [0, num_blocks); free queue in eviction order (LRU first), ref counts, hash -> block map.

    Free blocks are not wiped: a free block that is still in the hash map can be hit again (`touch`)
    until `get_new_blocks` pops it from the head of the queue and evicts its hash. Callers free a
    request's blocks tail first, so a prefix's last blocks are evicted before its first ones, which
    are the ones more likely shared.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer (got {num_blocks!r})")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # block_id -> block, head first: O(1) pop of the LRU head, append at the tail and removal
        # from the middle (a cache hit on a free block).
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # One block per hash: a second block computed with the same hash stays unregistered.
        self._cached: dict[bytes, KVBlock] = {}
        # Set by KVCacheManager.record_events: hashes leaving the map and resets become KV events.
        self.events: KVEventRecorder | None = None
        # owner -> its lent blocks; on_reclaim(owner, by_request) when one of them is taken from it
        self._lent: dict[object, list[KVBlock]] = {}
        self.on_reclaim: Callable[[object, bool], None] | None = None
        # wait_for_copy(event): the compute stream waits for a block's pending copy before a request writes it
        self.wait_for_copy: Callable[[object], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached-but-free ones included (they are evictable)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> set[bytes]:
        """The hashes of every block registered in the prefix cache (in use or free)."""
        return set(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their hashes; ref_cnt becomes 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        new_blocks = []
        waited: set[int] = set()  # one wait per event: an adapter's blocks share one
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            self._reclaim(block, by_request=True)
            event, block.pending_copy = block.pending_copy, None
            if event is not None and id(event) not in waited and self.wait_for_copy is not None:
                waited.add(id(event))
                self.wait_for_copy(event)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    # -- blocks lent to cached adapters ------------------------------------------------------------

    @property
    def num_lent_blocks(self) -> int:
        """Free blocks that hold a cached adapter's bytes (still free: any allocation may take them)."""
        return sum(len(blocks) for blocks in self._lent.values())

    def lend(self, num_blocks: int, owner: object) -> list[KVBlock]:
        """Tag the `num_blocks` least recently used free blocks with `owner` and move them to the tail of
        the queue (the most recently used idle memory), as if a request had used and freed them: their
        prefix hashes and earlier owners are evicted. They stay free. The caller checks there are enough.
        A block's pending copy stays set: the lender's copy runs on the same copy stream, after it."""
        if num_blocks > self.num_free_blocks or owner in self._lent:
            raise ValueError(f"cannot lend {num_blocks} of {self.num_free_blocks} free blocks to {owner!r}")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            self._reclaim(block, by_request=False)
            block.owner = owner
            self._free_queue[block.block_id] = block
            blocks.append(block)
        self._lent[owner] = blocks
        return blocks

    def hold_lent(self, owner: object) -> None:
        """Take the owner's blocks out of the free queue for a moment (while its copy is read back and
        other adapters are saved), so no `lend` in between takes them; `release_lent` puts them back."""
        for block in self._lent.get(owner, ()):
            del self._free_queue[block.block_id]

    def release_lent(self, owner: object) -> None:
        """Undo `hold_lent`: the blocks rejoin the free queue as its most recently used."""
        for block in self._lent.get(owner, ()):
            self._free_queue[block.block_id] = block

    def give_back(self, owner: object) -> None:
        """The owner drops its copy: its blocks stay free, untagged, where they are in the queue."""
        for block in self._lent.pop(owner, ()):
            block.owner = None

    def _reclaim(self, block: KVBlock, by_request: bool) -> None:
        owner = block.owner
        if owner is None:
            return
        self.give_back(owner)
        if self.on_reclaim is not None:
            self.on_reclaim(owner, by_request)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail of the queue, hash kept."""
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full block under its hash; False (nothing done) when caching is off, the block is
        registered already or the hash is taken."""
        if not self.enable_caching or block.block_hash == block_hash:
            return False
        if block.block_hash is not None:
            raise RuntimeError(f"block {block.block_id} is already cached under another hash")
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def uncache(self, block: KVBlock) -> None:
        """Forget a free block's hash (its K/V was never written); it stays in the free queue."""
        if block.ref_cnt != 0:
            raise RuntimeError(f"block {block.block_id} is in use; only a free block can be uncached")
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use, since its owner may rely on it."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
