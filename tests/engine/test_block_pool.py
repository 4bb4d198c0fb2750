"""BlockPool: allocation order, eviction order, ref counts and the hash map."""

import pytest

from engine.kv_cache import BlockPool


def ids(blocks):
    return [block.block_id for block in blocks]


def drain(pool):
    """Hand out every free block; their order is the free queue's eviction order."""
    return ids(pool.get_new_blocks(pool.num_free_blocks))


@pytest.mark.parametrize(
    ("num_blocks", "takes", "expected"),
    [
        (4, [1], [[0]]),
        (4, [2, 2], [[0, 1], [2, 3]]),
        (5, [3, 0, 2], [[0, 1, 2], [], [3, 4]]),
    ],
)
def test_new_blocks_come_from_the_head_in_id_order(num_blocks, takes, expected):
    pool = BlockPool(num_blocks, enable_caching=True)
    assert [ids(pool.get_new_blocks(n)) for n in takes] == expected
    assert pool.num_free_blocks == num_blocks - sum(takes)


@pytest.mark.parametrize(
    ("freed", "expected_order"),
    [
        ([0, 1, 2], [3, 4, 5, 0, 1, 2]),
        ([2, 1, 0], [3, 4, 5, 2, 1, 0]),  # what KVCacheManager.free passes: tail blocks first
        ([1], [3, 4, 5, 1]),
    ],
)
def test_freed_blocks_join_the_tail_in_the_given_order(freed, expected_order):
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[i] for i in freed])
    assert drain(pool) == expected_order


def test_a_block_returns_to_the_queue_only_when_its_last_reference_goes():
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert (block.ref_cnt, pool.num_free_blocks) == (1, 2)
    pool.free_blocks([block])
    assert (block.ref_cnt, pool.num_free_blocks) == (0, 3)


def test_touching_a_free_cached_block_takes_it_out_of_the_queue():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[1], b"h1")
    pool.free_blocks(reversed(blocks))
    hit = pool.get_cached_block(b"h1")
    assert hit is blocks[1]
    pool.touch([hit])
    assert (hit.ref_cnt, pool.num_free_blocks) == (1, 3)
    assert drain(pool) == [2, 3, 0]
    assert pool.get_cached_block(b"h1") is hit  # in use, so never evicted


def test_reusing_the_lru_block_evicts_its_hash_and_only_its_hash():
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"old")
    pool.cache_block(second, b"young")
    pool.free_blocks([first, second])  # first is now the least recently freed
    (reused,) = pool.get_new_blocks(1)
    assert reused is first
    assert (reused.block_hash, pool.get_cached_block(b"old")) == (None, None)
    assert pool.get_cached_block(b"young") is second
    assert pool.num_cached_blocks == 1


@pytest.mark.parametrize(
    ("num_blocks", "taken", "usage"), [(4, 0, 0.0), (4, 1, 0.25), (4, 4, 1.0), (8, 6, 0.75)]
)
def test_usage_is_the_fraction_of_blocks_in_use(num_blocks, taken, usage):
    pool = BlockPool(num_blocks, enable_caching=False)
    pool.get_new_blocks(taken)
    assert pool.usage == pytest.approx(usage)


def test_cached_free_blocks_count_as_free():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h")
    pool.free_blocks([block])
    assert (pool.num_free_blocks, pool.usage, pool.num_cached_blocks) == (2, 0.0, 1)


@pytest.mark.parametrize(("num_blocks", "taken", "asked"), [(2, 0, 3), (4, 3, 2), (4, 4, 1)])
def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing(num_blocks, taken, asked):
    pool = BlockPool(num_blocks, enable_caching=True)
    pool.get_new_blocks(taken)
    with pytest.raises(ValueError, match="free"):
        pool.get_new_blocks(asked)
    assert pool.num_free_blocks == num_blocks - taken


def test_freeing_a_free_block_is_a_bug():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([block])


@pytest.mark.parametrize(
    ("enable_caching", "second_hash", "cached_first", "cached_second"),
    [
        (True, b"other", b"h", b"other"),
        (True, b"h", b"h", None),  # a duplicate stays unregistered; the first block keeps the hash
        (False, b"other", None, None),  # caching off: nothing is ever registered
    ],
)
def test_cache_block(enable_caching, second_hash, cached_first, cached_second):
    pool = BlockPool(2, enable_caching=enable_caching)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"h")
    pool.cache_block(second, second_hash)
    assert (first.block_hash, second.block_hash) == (cached_first, cached_second)
    assert pool.get_cached_block(b"h") is (first if enable_caching else None)


@pytest.mark.parametrize(("in_use", "reset"), [(False, True), (True, False)])
def test_reset_prefix_cache_only_when_nothing_is_in_use(in_use, reset):
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"h")
    pool.free_blocks([first] + ([] if in_use else [second]))
    assert pool.reset_prefix_cache() is reset
    assert (pool.get_cached_block(b"h") is None) is reset


def test_lent_blocks_stay_free_and_join_one_lru_with_cached_prefixes():
    """Blocks lent to a cached adapter (engine/lora/kv_tier.py) count as free, sit where a freed request's
    blocks would, and go to the first allocation that reaches them, which takes the owner's whole copy."""
    pool = BlockPool(6, enable_caching=True)
    lost = []
    pool.on_reclaim = lambda owner, by_request: lost.append((owner, by_request))
    prefix = pool.get_new_blocks(2)  # blocks 0, 1: a request's, registered, then freed
    pool.cache_block(prefix[0], b"h0")
    pool.free_blocks(prefix)
    lent = pool.lend(2, "a")  # the LRU head: 2, 3 (never used) -> the tail, tagged
    assert ids(lent) == [2, 3] and pool.num_free_blocks == 6 and pool.num_lent_blocks == 2
    assert pool.get_cached_block(b"h0") is prefix[0]
    pool.lend(2, "b")  # 4, 5
    pool.hold_lent("a")  # "a" restored: held, then released as the most recent idle memory
    pool.release_lent("a")
    # the queue is now 0 (h0), 1, 4, 5 (b), 2, 3 (a): an allocation of 3 evicts h0 and takes b's block 4
    assert ids(pool.get_new_blocks(3)) == [0, 1, 4]
    assert pool.get_cached_block(b"h0") is None
    assert lost == [("b", True)] and pool.num_lent_blocks == 2  # b's other block is plain free now
    assert pool.blocks[5].owner is None and pool.blocks[2].owner == "a"
    pool.give_back("a")
    assert pool.num_lent_blocks == 0 and pool.num_free_blocks == 3 and lost == [("b", True)]


def test_a_lend_evicts_prefix_hashes_and_other_owners_like_an_allocation():
    pool = BlockPool(3, enable_caching=True)
    lost = []
    pool.on_reclaim = lambda owner, by_request: lost.append((owner, by_request))
    pool.lend(2, "a")
    held = pool.get_new_blocks(1)  # block 2
    pool.cache_block(held[0], b"h")
    pool.free_blocks(held)  # queue: 0, 1 (a), 2 (h)
    pool.hold_lent("a")  # out of the queue for a moment: no lend may take them
    with pytest.raises(ValueError):
        pool.lend(2, "b")
    pool.release_lent("a")  # queue: 2 (h), 0, 1 (a)
    pool.lend(2, "b")  # takes 2 (evicting h) and 0 (a's): a loses its copy, not by a request
    assert lost == [("a", False)] and pool.get_cached_block(b"h") is None
    assert sorted(b.block_id for b in pool.blocks if b.owner == "b") == [0, 2]
