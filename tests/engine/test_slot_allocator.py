"""SlotAllocator: empty slots first, LRU among unpinned, pinned slots never evicted."""

from __future__ import annotations

import pytest

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
