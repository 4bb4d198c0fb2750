"""Idle KV-cache blocks as an adapter tier: copies of adapters evicted from their GPU slots (Chameleon's idea).

The KV cache is mostly idle memory when the batch is small; an adapter that loses its slot keeps a copy of
its pool pages in free KV blocks, and a later request brings it back with a device-to-device copy instead of
the host-to-device copy out of the CPU tier (or a disk or store load once the CPU tier dropped it). The
blocks stay free: the block pool (engine/kv_cache/block_pool.py) counts them as free and hands them to the
first allocation that reaches them in its LRU order, and the adapter loses its copy at that moment
(`_reclaimed`). So the tier grows into the KV memory that requests leave idle and shrinks as they need it,
and no request ever waits or is refused for a block because of it.

Bytes, not tensors: the KV cache is one tensor [2 * num_layers, num_blocks + 1, block_size, kv_heads,
head_dim] (the model runner hands each layer views of it), seen here as words [2 * num_layers,
num_blocks + 1, c]. An adapter of P pages is P * page_bytes bytes laid out tensor-major over k blocks
(k = ceil(bytes / (2 * num_layers * c))): its words [t * k * c, (t + 1) * k * c) go to the blocks' rows in
tensor t. One staging buffer of the largest adapter (allocated with the pool, before the KV cache is
sized) turns a save or a restore into three copies on the device whatever the layer count: pool pages ->
staging -> blocks (one scatter) and back (one gather).

Streams (CUDA): every copy runs on the adapter manager's copy stream, after it waited for the compute
stream, so it follows whatever earlier steps wrote into the blocks and pages, and precedes the slot's later
host-to-device copies in the same stream. Each block keeps the event of the last copy into or out of it
(`KVBlock.pending_copy`) until a request's allocation takes it, whatever became of the copy meanwhile
(dropped, or lost when another request or another adapter's save took one of its blocks): that allocation
makes the compute stream, recorded when the tier is built, wait for the event before the step that writes
the block (no host sync). Another save that takes the block runs on the same copy stream, after the copy.
Not used with tensor parallelism (each rank would have to keep its own shard; the engine turns the tier
off there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.lora.pages import runs
from engine.lora.pool import LoRAPool

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class KVEntry:
    """One adapter's copy in KV blocks: the block pool's owner tag for them."""

    adapter_id: str
    block_ids: torch.Tensor  # [k] int64 on the device: the blocks, in the order the bytes fill them
    num_pages: int
    table: torch.Tensor  # [num_layers, table_columns] int32 on the device: its slot's scales and ranks
    buckets: int  # its kernel rank buckets (LoRAPool.slot_buckets)
    blocks: list[KVBlock] = field(default_factory=list)  # the block pool's blocks behind block_ids


def staging_words(pool: LoRAPool, block_bytes: int, num_rows: int) -> tuple[torch.dtype, int]:
    """The word dtype the copies move and the staging buffer's length in words: the largest adapter's
    bytes rounded up to whole blocks (so a restore's gather fills whole blocks). `block_bytes`: one KV
    block over every layer's K and V; `num_rows`: 2 * num_layers (the KV cache tensor's first dimension)."""
    page_bytes = pool.layout.page_numel * pool.weights.element_size()
    row_bytes = block_bytes // num_rows  # one block of one K or V tensor
    word = torch.int64 if page_bytes % 8 == 0 and row_bytes % 8 == 0 else torch.uint8
    unit = block_bytes
    blocks = -(-pool.layout.max_pages * page_bytes // unit)
    return word, blocks * unit // torch.empty((), dtype=word).element_size()


class AdapterKVTier:
    def __init__(
        self,
        block_pool: BlockPool,
        kv_storage: torch.Tensor,
        staging: torch.Tensor,
        pool: LoRAPool,
        emit: Callable[[str, str], None],
    ):
        word = staging.dtype
        self.block_pool = block_pool
        self.pool = pool
        # [2 * num_layers, num_blocks + 1, c] words of the KV cache; the pool's pages as words
        self._blocks = kv_storage.view(kv_storage.shape[0], kv_storage.shape[1], -1).view(word)
        self._pages = pool.weights.view(word)  # [num_pages, page_words]
        self._staging = staging  # [staging_words] of `word`
        self._page_words = self._pages.shape[1]
        self._block_words = self._blocks.shape[0] * self._blocks.shape[2]
        self._cuda = kv_storage.device.type == "cuda"
        # The stream requests' K/V is written on (built on it); None on the CPU, where copies are synchronous
        self._compute_stream = torch.cuda.current_stream(kv_storage.device) if self._cuda else None
        self._emit = emit
        self.entries: dict[str, KVEntry] = {}
        self.on_lost: Callable[[str], None] = lambda adapter_id: None  # the manager's record update
        block_pool.on_reclaim = self._reclaimed
        block_pool.wait_for_copy = self._compute_waits_for

    def close(self) -> None:
        """Let go of the block pool, the KV cache's view, the staging buffer and the pool (engine shutdown):
        the block pool's hooks no longer reach this object, so the KV cache frees once its owners drop it."""
        if self.block_pool.on_reclaim == self._reclaimed:
            self.block_pool.on_reclaim = self.block_pool.wait_for_copy = None
        for entry in self.entries.values():
            self.block_pool.give_back(entry)
        for block in self.block_pool.blocks:
            block.pending_copy = None
        self.entries.clear()
        self.block_pool = self.pool = self._blocks = self._pages = self._staging = None
        self._compute_stream = None

    # -- what the manager asks -----------------------------------------------------------------------

    def has(self, adapter_id: str) -> bool:
        return adapter_id in self.entries

    @property
    def num_adapters(self) -> int:
        """Adapters with a copy in KV blocks, those back in a GPU slot included (their copy is kept, so
        losing the slot again costs no save)."""
        return len(self.entries)

    def num_pages(self, adapter_id: str) -> int:
        return self.entries[adapter_id].num_pages

    @property
    def num_blocks(self) -> int:
        """KV blocks that hold cached adapters now (free blocks: any allocation may take them)."""
        return self.block_pool.num_lent_blocks

    def blocks_for(self, num_pages: int) -> int:
        return -(-num_pages * self._page_words // self._block_words)

    def save(self, adapter_id: str, slot: int, pages: list[int]) -> bool:
        """Copy the adapter in `slot` (its pool `pages`, in rank order) into free KV blocks; False (nothing
        done) when it would take more than half of the free blocks: under that much pressure its copy
        would be reclaimed before it is used. Call on the copy stream, before the pages are reused."""
        k = self.blocks_for(len(pages))
        if not pages or k > self.block_pool.num_free_blocks // 2 or adapter_id in self.entries:
            return False
        table = self.pool.table[:, :, slot].clone()
        entry = KVEntry(adapter_id, torch.empty(0), len(pages), table, int(self.pool.slot_buckets[slot]))
        entry.blocks = self.block_pool.lend(k, entry)
        entry.block_ids = self._index([b.block_id for b in entry.blocks])
        staged = self._staged(k)
        flat = staged.view(-1)
        for start, first, count in runs(pages):
            w = self._page_words
            flat[start * w : (start + count) * w].copy_(self._pages[first : first + count].view(-1))
        self._blocks[:, entry.block_ids] = staged  # the tail past the adapter's bytes is don't-care
        self.entries[adapter_id] = entry
        self._mark_busy(entry)
        return True

    def restore(self, adapter_id: str, slot: int, pages: list[int]) -> None:
        """Copy the adapter back into `pages` (at least its pages' count, from the allocator) and point
        `slot` at them: bit for bit what was saved. Call on the copy stream."""
        entry = self.entries[adapter_id]
        k = entry.block_ids.numel()
        staged = self._staged(k)
        torch.index_select(self._blocks, 1, entry.block_ids, out=staged)
        flat = staged.view(-1)
        for start, first, count in runs(list(pages[: entry.num_pages])):
            w = self._page_words
            self._pages[first : first + count].view(-1).copy_(flat[start * w : (start + count) * w])
        self.pool.point(slot, pages[: entry.num_pages], entry.table, entry.buckets)
        self._mark_busy(entry)

    def hold(self, adapter_id: str) -> None:
        """Keep the adapter's blocks from any `save` until `release` (while it is given a slot, whose
        victims are saved first, and copied back)."""
        self.block_pool.hold_lent(self.entries[adapter_id])

    def release(self, adapter_id: str) -> None:
        """Undo `hold`: the blocks are free again, the most recently used idle memory."""
        self.block_pool.release_lent(self.entries[adapter_id])

    def drop(self, adapter_id: str) -> None:
        """Forget the adapter's copy (retired, deleted): its blocks stay free, untagged."""
        entry = self.entries.pop(adapter_id, None)
        if entry is not None:  # a copy still in flight: the blocks' pending_copy makes their next user wait
            self.block_pool.give_back(entry)

    # -- internals ----------------------------------------------------------------------------------

    def _staged(self, k: int) -> torch.Tensor:
        """The staging buffer's first k blocks' words as [2 * num_layers, k, c]."""
        rows, _, c = self._blocks.shape
        return self._staging[: k * self._block_words].view(rows, k, c)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if not self._cuda:
            return ids
        # from page-locked memory, so the copy is queued on the stream instead of syncing it
        return ids.pin_memory().to(self._blocks.device, non_blocking=True)

    def _mark_busy(self, entry: KVEntry) -> None:
        """After a copy into or out of the entry's blocks (on the copy stream): their next user waits for it."""
        if self._compute_stream is not None:
            event = self._record_event()
            for block in entry.blocks:
                block.pending_copy = event

    def _record_event(self):
        """An event at the current point of the current (copy) stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._blocks.device))
        return event

    def _compute_waits_for(self, event) -> None:
        """A request's allocation took a block with a copy in flight: the compute stream waits for it."""
        if not event.query():
            self._compute_stream.wait_event(event)

    def _reclaimed(self, entry: KVEntry, by_request: bool) -> None:
        """The block pool took one of the entry's blocks: the whole copy is gone."""
        if self.entries.get(entry.adapter_id) is not entry:
            return
        del self.entries[entry.adapter_id]
        self._emit("evict", "kv")  # by a request's allocation or another adapter's save
        self.on_lost(entry.adapter_id)
