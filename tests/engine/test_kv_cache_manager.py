"""KVCacheManager: block tables, prefix hits (never across adapters), atomic allocation."""

import pytest

from engine.kv_cache import KVCacheManager, extend_block_hashes, hash_block_tokens
from engine.kv_cache.block_hash import ROOT_BLOCK_HASH
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id, token_ids, adapter_id=None):
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8), adapter_id=adapter_id)


def compute(manager, request, num_new_tokens=None, hits=()):
    """Allocate and mark computed, as one engine step would."""
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - request.num_computed_tokens - len(hits) * BLOCK_SIZE
    assert manager.allocate_slots(request, num_new_tokens, hits) is not None
    request.num_computed_tokens += len(hits) * BLOCK_SIZE + num_new_tokens


def make_manager(num_blocks=16, enable_caching=True):
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)


@pytest.mark.parametrize(
    ("first", "first_adapter", "second", "second_adapter", "hit_tokens"),
    [
        (range(10), "a", range(10), "a", 8),
        (range(10), None, range(10), None, 8),
        (range(10), "a", range(10), "b", 0),  # same tokens, other adapter: other K/V
        (range(10), "a", range(10), None, 0),
        (range(10), None, range(10), "a", 0),
        (range(10), "", range(10), None, 0),  # the empty adapter id is not "no adapter"
        (range(10), "a", [*range(6), 99, 99, 99], "a", 4),  # diverges inside block 1
        (
            [0, 1, 2, 3, 4, 5, 6, 7, 8],
            "a",
            [9, 9, 9, 9, 4, 5, 6, 7, 8],
            "a",
            0,
        ),  # chained: block 1 alone never hits
        (range(8), "a", range(8), "a", 4),  # whole prompt cached: the last token is still computed
        (range(8), "a", range(9), "a", 8),
        (range(3), "a", range(3), "a", 0),  # partial blocks are never cached
    ],
)
def test_prefix_hits(first, first_adapter, second, second_adapter, hit_tokens):
    manager = make_manager()
    owner = make_request("owner", first, first_adapter)
    compute(manager, owner)
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("reader", second, second_adapter))
    assert num_hit_tokens == hit_tokens
    assert [b.block_id for b in hits] == manager.get_block_ids("owner")[: hit_tokens // BLOCK_SIZE]


def test_no_hits_with_caching_off():
    manager = make_manager(enable_caching=False)
    compute(manager, make_request("owner", range(10)))
    assert manager.get_computed_blocks(make_request("reader", range(10))) == ([], 0)
    assert manager.block_pool.num_cached_blocks == 0


@pytest.mark.parametrize(
    ("num_tokens", "steps", "cached_after_each"),
    [
        (10, [10], [2]),  # the partial last block is not cached
        (12, [12], [3]),
        (10, [3, 4, 3], [0, 1, 2]),  # chunked: a block is cached once its step will fill it
        (10, [5, 5], [1, 2]),
    ],
)
def test_full_blocks_are_cached_when_allocated(num_tokens, steps, cached_after_each):
    manager = make_manager()
    request = make_request("r", range(num_tokens))
    cached = []
    for num_new_tokens in steps:
        compute(manager, request, num_new_tokens)
        cached.append(manager.block_pool.num_cached_blocks)
    assert cached == cached_after_each


def test_a_block_filled_by_decoding_is_cached_with_the_output_tokens():
    manager = make_manager()
    request = make_request("r", range(7))
    compute(manager, request)
    request.append_output_token(100)
    compute(manager, request, 1)
    assert manager.block_pool.num_cached_blocks == 2
    _, hit_tokens = manager.get_computed_blocks(make_request("reader", [*range(7), 100, 5]))
    assert hit_tokens == 8


@pytest.mark.parametrize(
    ("num_tokens", "computed", "num_new_tokens", "table_len", "new_len"),
    [
        (10, 0, 10, 3, 3),
        (10, 0, 4, 1, 1),
        (10, 4, 1, 2, 1),  # the 5th token opens block 1
        (10, 5, 3, 2, 0),  # fits the open block
        (10, 8, 2, 3, 1),
    ],
)
def test_allocate_slots_grows_the_table_by_whole_blocks(
    num_tokens, computed, num_new_tokens, table_len, new_len
):
    manager = make_manager(enable_caching=False)
    request = make_request("r", range(num_tokens))
    if computed:
        compute(manager, request, computed)
    new_blocks = manager.allocate_slots(request, num_new_tokens)
    table = manager.get_block_ids("r")
    assert (len(table), len(new_blocks)) == (table_len, new_len)
    assert table[table_len - new_len :] == [b.block_id for b in new_blocks]  # appended at the end


def test_allocate_returns_none_and_changes_nothing_when_short():
    manager = make_manager(num_blocks=4)
    compute(manager, make_request("holder", range(12)))
    request = make_request("r", range(5))
    before = (manager.block_pool.num_free_blocks, manager.num_queries_tokens, manager.num_hit_tokens)
    assert manager.allocate_slots(request, 5) is None
    assert manager.get_block_ids("r") == []
    assert (manager.block_pool.num_free_blocks, manager.num_queries_tokens, manager.num_hit_tokens) == before


def test_hits_on_free_blocks_count_against_the_free_blocks():
    manager = make_manager(num_blocks=4)
    owner = make_request("owner", range(9))
    compute(manager, owner)  # blocks 0, 1 cached, block 2 partial
    manager.free(owner)  # free queue: 3, 2, 1, 0
    compute(manager, make_request("holder", [50] * 8))  # takes 3 and 2
    reader = make_request("reader", range(9))
    hits, hit_tokens = manager.get_computed_blocks(reader)
    assert [b.block_id for b in hits] == [0, 1]
    # 1 new block + 2 free hits > 2 free blocks: refused, nothing touched.
    assert manager.allocate_slots(reader, 1, hits) is None
    assert [b.ref_cnt for b in hits] == [0, 0]
    assert manager.block_pool.num_free_blocks == 2


def test_free_then_hit_again_reuses_the_same_blocks():
    manager = make_manager()
    owner = make_request("owner", range(10), "a")
    compute(manager, owner)
    owner_blocks = manager.get_block_ids("owner")
    manager.free(owner)
    assert manager.get_block_ids("owner") == []
    assert manager.usage == 0.0
    reader = make_request("reader", range(10), "a")
    hits, hit_tokens = manager.get_computed_blocks(reader)
    compute(manager, reader, hits=hits)
    assert manager.get_block_ids("reader")[:2] == owner_blocks[:2]
    assert [b.ref_cnt for b in hits] == [1, 1]
    assert (manager.num_queries_tokens, manager.num_hit_tokens) == (20, 8)


def test_shared_blocks_stay_until_their_last_reader_frees_them():
    manager = make_manager(num_blocks=6)
    owner = make_request("owner", range(10))
    compute(manager, owner)
    reader = make_request("reader", range(10))
    hits, _ = manager.get_computed_blocks(reader)
    compute(manager, reader, hits=hits)
    manager.free(owner)
    assert [b.ref_cnt for b in hits] == [1, 1]
    manager.free(reader)
    assert manager.block_pool.num_free_blocks == 6


def test_blocks_freed_before_their_step_ran_are_never_hit():
    """A request preempted in the step that allocated its blocks (before the step ran) leaves them
    unwritten: they must leave the prefix cache, while the blocks it did compute stay in it."""
    manager = make_manager()
    owner = make_request("owner", range(13))
    compute(manager, owner, 6)  # block 0 written; block 1 half
    assert manager.allocate_slots(owner, 7) is not None  # blocks 1, 2 registered for this step
    assert not manager.shares_unwritten_blocks(owner)
    manager.free(owner)  # preempted before the step ran
    reader = make_request("reader", range(13))
    hits, hit_tokens = manager.get_computed_blocks(reader)
    assert hit_tokens == BLOCK_SIZE


def test_missing_freeable_and_shared_unwritten_blocks():
    manager = make_manager(num_blocks=6)
    owner = make_request("owner", range(9))
    assert manager.allocate_slots(owner, 9) is not None  # 3 blocks, 2 registered, nothing computed
    reader = make_request("reader", range(9))
    hits, _ = manager.get_computed_blocks(reader)
    assert len(hits) == 2
    # 1 new block for the reader; 3 free blocks; the big one lacks 2.
    assert manager.num_missing_blocks(reader, 1, hits) == 0
    assert manager.num_missing_blocks(make_request("big", range(20)), 20) == 2
    compute(manager, reader, 1, hits)
    assert manager.shares_unwritten_blocks(owner)  # the reader hit blocks the owner still has to write
    assert (manager.num_freeable_blocks(owner), manager.num_freeable_blocks(reader)) == (1, 1)
    owner.num_computed_tokens = 9  # the step ran
    assert not manager.shares_unwritten_blocks(owner)


def test_prefix_hits_only_before_anything_is_computed():
    manager = make_manager()
    owner = make_request("owner", range(10))
    compute(manager, owner)
    reader = make_request("reader", range(10))
    hits, _ = manager.get_computed_blocks(reader)
    compute(manager, reader, 1)
    with pytest.raises(ValueError, match="before anything is computed"):
        manager.allocate_slots(reader, 1, hits)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (17, 5)])
def test_num_blocks_needed(num_tokens, blocks):
    assert make_manager().num_blocks_needed(num_tokens) == blocks


@pytest.mark.parametrize(
    ("adapter_a", "adapter_b"), [(None, ""), ("a", "b"), (None, "a"), ("x", "x\x00"), ("é", "e")]
)
def test_block_hash_separates_adapters(adapter_a, adapter_b):
    tokens = [1, 2, 3, 4]
    assert hash_block_tokens(ROOT_BLOCK_HASH, tokens, adapter_a) != hash_block_tokens(
        ROOT_BLOCK_HASH, tokens, adapter_b
    )


def test_block_hashes_extend_incrementally():
    tokens = list(range(11))
    incremental: list[bytes] = []
    for end in range(1, len(tokens) + 1):
        extend_block_hashes(incremental, tokens[:end], BLOCK_SIZE, "a")
    assert incremental == extend_block_hashes([], tokens, BLOCK_SIZE, "a")
    assert len(incremental) == 2
    assert incremental[1] == hash_block_tokens(incremental[0], tokens[4:8], "a")
