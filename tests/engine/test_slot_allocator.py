"""SlotAllocator: empty slots first, LRU among unpinned, pinned slots never evicted."""

from __future__ import annotations

import pytest

from engine.lora.pages import PageAllocator, pages_for_rank, runs
from engine.lora.slot_allocator import SlotAllocator

# Each case: a sequence of ("acquire"|"release"|"evict", adapter) and the expected result of each op:
# (slot, needs_load) for acquire, None for release, bool for evict.
CASES = {
    "fills_empty_slots_in_order": (
        2,
        [("acquire", "a"), ("acquire", "b")],
        [(0, True), (1, True)],
    ),
    "resident_adapter_is_a_hit": (
        2,
        [("acquire", "a"), ("release", "a"), ("acquire", "a")],
        [(0, True), None, (0, False)],
    ),
    "evicts_least_recently_used_unpinned": (
        2,
        [
            ("acquire", "a"),
            ("acquire", "b"),
            ("release", "a"),
            ("release", "b"),
            ("acquire", "a"),
            ("release", "a"),
            ("acquire", "c"),
        ],
        [(0, True), (1, True), None, None, (0, False), None, (1, True)],
    ),
    "pinned_slot_survives": (
        2,
        [("acquire", "a"), ("acquire", "b"), ("release", "b"), ("acquire", "c")],
        [(0, True), (1, True), None, (1, True)],
    ),
    "evict_refuses_pinned_then_frees": (
        1,
        [("acquire", "a"), ("evict", "a"), ("release", "a"), ("evict", "a"), ("acquire", "b")],
        [(0, True), False, None, True, (0, True)],
    ),
}


@pytest.mark.parametrize("num_slots, ops, expected", CASES.values(), ids=CASES.keys())
def test_slot_allocation(num_slots, ops, expected):
    allocator = SlotAllocator(num_slots)
    results = [getattr(allocator, op)(adapter) for op, adapter in ops]
    assert results == expected


def test_all_pinned_raises_and_counts():
    allocator = SlotAllocator(2)
    allocator.acquire("a")
    allocator.acquire("b")
    assert allocator.num_pinned == 2 and not allocator.can_acquire("c")
    with pytest.raises(RuntimeError, match="pinned"):
        allocator.acquire("c")
    allocator.release("b")
    assert allocator.can_acquire("c")
    assert allocator.acquire("c") == (1, True) and allocator.num_evictions == 1


def test_release_without_acquire_raises():
    with pytest.raises(RuntimeError, match="released more often"):
        SlotAllocator(1).release("a")


# Pages: (num_slots, num_pages, ops of ("acquire", adapter, pages) | ("release"|"evict", adapter), then
# the expected (slot, needs_load) or result of each op, and the pages each adapter holds at the end).
PAGE_CASES = {
    "small_adapters_share_what_one_large_would_take": (
        4,
        8,
        [("acquire", "big", 8), ("release", "big"), ("acquire", "s1", 1), ("acquire", "s2", 2)],
        [(0, True), None, (0, True), (1, True)],
        {"s1": [0], "s2": [1, 2]},
    ),
    "evicts_lru_until_the_pages_fit_even_with_a_free_slot": (
        4,
        4,
        [
            ("acquire", "a", 2),
            ("acquire", "b", 2),
            ("release", "a"),
            ("release", "b"),
            ("acquire", "c", 3),  # slots are free, pages are not: a then b go, LRU first
        ],
        [(0, True), (1, True), None, None, (1, True)],
        {"c": [0, 1, 2]},
    ),
    "a_freed_hole_is_reused_without_compaction": (
        3,
        6,
        [
            ("acquire", "a", 2),
            ("acquire", "b", 2),
            ("acquire", "c", 2),
            ("release", "b"),
            ("evict", "b"),
            ("acquire", "d", 1),
            ("acquire", "e", 1),
        ],
        [(0, True), (1, True), (2, True), None, True, (1, True), None],
        {"a": [0, 1], "c": [4, 5], "d": [2]},
    ),
    "scattered_free_pages_still_serve": (
        4,
        4,
        [
            ("acquire", "a", 1),
            ("acquire", "b", 1),
            ("acquire", "c", 1),
            ("release", "a"),
            ("release", "c"),
            ("evict", "a"),
            ("evict", "c"),
            ("acquire", "d", 3),  # pages 0, 2, 3: no run of three, but room
        ],
        [(0, True), (1, True), (2, True), None, None, True, True, (2, True)],
        {"b": [1], "d": [0, 2, 3]},
    ),
}


@pytest.mark.parametrize(
    "num_slots, num_pages, ops, expected, held", PAGE_CASES.values(), ids=PAGE_CASES.keys()
)
def test_page_allocation(num_slots, num_pages, ops, expected, held):
    allocator = SlotAllocator(num_slots, num_pages)
    results = []
    for op, adapter, *pages in ops:
        if op == "acquire" and not allocator.can_acquire(adapter, num_pages=pages[0]):
            results.append(None)  # no room: waits, nothing changes
            continue
        results.append(getattr(allocator, op)(adapter, *([frozenset()] + pages if pages else [])))
    assert results == expected
    assert {a: allocator.pages_of(a) for a in allocator.adapter_ids()} == held
    used = sum(len(p) for p in held.values())
    assert allocator.num_free_pages == num_pages - used, "every page is either held or free"


def test_pinned_adapters_keep_their_pages_and_protected_ones_are_skipped():
    allocator = SlotAllocator(4, 4)
    allocator.acquire("pinned", num_pages=2)
    allocator.acquire("kept", num_pages=1)
    allocator.release("kept")
    assert not allocator.can_acquire("wide", frozenset({"kept"}), num_pages=3)
    assert allocator.can_acquire("wide", num_pages=2)
    with pytest.raises(RuntimeError, match="no room"):
        allocator.acquire("wide", frozenset({"kept"}), num_pages=3)
    assert allocator.acquire("wide", num_pages=2) == (1, True)
    assert allocator.pages_of("wide") == [2, 3] and allocator.pages_of("pinned") == [0, 1]
    assert allocator.slot_pages(1) == [2, 3] and allocator.num_evictions == 1
    assert not allocator.can_acquire("too-big", num_pages=5)


def test_page_allocator_prefers_runs_and_refuses_double_frees():
    pages = PageAllocator(6)
    assert pages.allocate(2) == [0, 1] and pages.allocate(1) == [2]
    pages.free([0])
    assert pages.allocate(2) == [3, 4], "a run of two beats the lone page 0"
    assert pages.allocate(2) == [0, 5] and pages.num_free == 0
    with pytest.raises(RuntimeError, match="only 0 of 6"):
        pages.allocate(1)
    pages.free([5])
    with pytest.raises(RuntimeError, match="freed twice"):
        pages.free([5])
    assert runs([4, 5, 6, 9, 2]) == [(0, 4, 3), (3, 9, 1), (4, 2, 1)]
    assert pages_for_rank(8, 8) == 1 and pages_for_rank(9, 8) == 2 and pages_for_rank(0, 8) == 0


def test_vocab_slots_hold_adapters_with_their_own_embedding_or_head_and_others_take_them_last():
    """Slots 0 .. vocab_slots - 1 have room for an adapter's own embedding / LM head (engine/lora/vocab.py)."""
    alloc = SlotAllocator(4, vocab_slots=2)
    assert alloc.acquire("plain-a")[0] == 2 and alloc.acquire("plain-b")[0] == 3  # past the vocab slots
    assert alloc.acquire("head-a", vocab=True)[0] == 0
    assert alloc.acquire("plain-c")[0] == 1  # no other slot free: a plain adapter takes a vocab slot
    alloc.release("plain-c")
    # every vocab slot in use: the LRU unpinned adapter holding one is evicted, never one elsewhere
    assert alloc.can_acquire("head-b", vocab=True)
    assert alloc.acquire("head-b", vocab=True) == (1, True)
    assert alloc.lookup("plain-c") is None and alloc.lookup("plain-a") == 2
    assert not alloc.can_acquire("head-c", vocab=True), "both vocab slots are pinned"
    alloc.release("plain-a")
    assert alloc.can_acquire("plain-d") and not alloc.can_acquire("head-c", vocab=True)
