"""The KV tier's stream order (engine/lora/kv_tier.py), on the CPU with fake events and streams: a block
whose save or restore copy may still be queued on the copy stream makes the request allocation that takes
it next wait for that copy, whatever became of the copy meanwhile (dropped, lost to a request, lost to
another adapter's save), and only then; another save that takes the block waits on nothing (it runs on the
same copy stream, after the copy)."""

from __future__ import annotations

import itertools

import torch

from adapter_format.model_shape import ModelShape
from engine.kv_cache.block_pool import BlockPool
from engine.lora.kv_tier import AdapterKVTier, staging_words
from engine.lora.pool import LoRAPool

SHAPE = ModelShape(
    num_layers=2, hidden_size=32, intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16
)


class FakeEvent:
    def __init__(self, name: str):
        self.name, self.done = name, False

    def query(self) -> bool:
        return self.done

    def __repr__(self) -> str:
        return self.name


class FakeStream:
    def __init__(self):
        self.waited: list[str] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event.name)


def make_tier(num_blocks: int = 8):
    """A tier whose adapters (one pool page) take two KV blocks each, with fake CUDA streams and events:
    every copy records the next event, e1, e2, ..."""
    pool = LoRAPool(SHAPE, max_loras=2, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    c = -(-pool.layout.page_numel // 4)  # two blocks of [2, c] float32 words hold one page, one does not
    storage = torch.zeros(2, num_blocks + 1, c)
    word, words = staging_words(pool, storage[:, 0].numel() * 4, storage.shape[0])
    blocks = BlockPool(num_blocks, enable_caching=True)
    tier = AdapterKVTier(blocks, storage, torch.empty(words, dtype=word), pool, lambda *a: None)
    assert tier.blocks_for(1) == 2
    compute = FakeStream()
    numbers = itertools.count(1)
    tier._compute_stream = compute  # what CUDA would give it: the stream it was built on
    tier._record_event = lambda: FakeEvent(f"e{next(numbers)}")
    return tier, blocks, compute


def pending(blocks: BlockPool, *block_ids: int) -> list[str | None]:
    return [repr(blocks.blocks[i].pending_copy) if blocks.blocks[i].pending_copy else None for i in block_ids]


def test_every_block_with_a_copy_in_flight_makes_the_next_request_allocation_wait():
    tier, blocks, compute = make_tier()
    request = blocks.get_new_blocks(1)  # block 0, in use
    assert tier.save("a", 0, [0])  # blocks 1, 2: e1
    blocks.free_blocks(request)  # queue: 3..7, 1, 2 (a), 0
    assert tier.save("b", 0, [0]) and tier.save("c", 0, [0])  # 3, 4: e2; 5, 6: e3
    assert pending(blocks, 0, 1, 2, 3, 5, 7) == [None, "e1", "e1", "e2", "e3", None]

    # another save takes 7 and a's block 1: a's copy is lost, its block 2 keeps a's event
    assert tier.save("d", 0, [0])  # e4
    assert not tier.has("a") and compute.waited == []  # the save runs on the copy stream, after e1
    assert blocks.blocks[2].owner is None and pending(blocks, 1, 2, 7) == ["e4", "e1", "e4"]

    # queue: 2, 0, 3, 4 (b), 5, 6 (c), 7, 1 (d): a request takes 2 (a's lost copy) and 0
    blocks.get_new_blocks(2)
    assert compute.waited == ["e1"] and pending(blocks, 2) == [None]
    # a request takes b's block 3: b is lost; the next request that takes b's block 4 waits too
    blocks.get_new_blocks(1)
    assert not tier.has("b") and compute.waited == ["e1", "e2"]
    blocks.get_new_blocks(1)
    assert compute.waited == ["e1", "e2", "e2"]

    # a restore reads c's blocks (e5); then c is dropped: its blocks wait for the restore, not the save
    tier.hold("c")
    tier.release("c")
    tier.restore("c", 1, [1])
    assert pending(blocks, 5, 6) == ["e5", "e5"]
    tier.drop("c")
    assert compute.waited == ["e1", "e2", "e2"] and pending(blocks, 5, 6) == ["e5", "e5"]

    # a copy known to be done costs no wait; one wait per event per allocation
    blocks.blocks[7].pending_copy.done = True  # d's e4
    queue = [b.block_id for b in blocks._free_queue.values()]
    assert queue == [7, 1, 5, 6]
    blocks.get_new_blocks(4)
    assert compute.waited == ["e1", "e2", "e2", "e5"]
    assert not tier.has("d") and pending(blocks, *range(8)) == [None] * 8


def test_a_tier_without_copies_in_flight_never_waits():
    tier, blocks, compute = make_tier()
    tier._compute_stream = None  # the CPU: copies are synchronous, no events
    assert tier.save("a", 0, [0])
    blocks.get_new_blocks(8)
    assert compute.waited == [] and not tier.has("a")
