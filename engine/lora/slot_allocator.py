"""Which adapter occupies which GPU slot: LRU among unpinned slots, pinned while a request runs."""

from __future__ import annotations

from collections import OrderedDict

EMPTY_SLOT = None


class SlotAllocator:
    """Maps adapter ids to `num_slots` slots.

    A slot is pinned (ref count > 0) while any running request uses its adapter and is then never
    evicted. Among unpinned slots the least recently used adapter is evicted first; empty slots are
    used before anything is evicted.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive (got {num_slots})")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU first
        self._ref_cnt: dict[str, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.num_evictions = 0

    def lookup(self, adapter_id: str) -> int | None:
        return self._slot_of.get(adapter_id)

    def adapter_ids(self) -> list[str]:
        """The adapters holding a slot, least recently used first."""
        return list(self._slot_of)

    def can_acquire(self, adapter_id: str, protected: frozenset[str] = frozenset()) -> bool:
        return (
            adapter_id in self._slot_of or bool(self._free_slots) or self._lru_unpinned(protected) is not None
        )

    def acquire(self, adapter_id: str, protected: frozenset[str] = frozenset()) -> tuple[int, bool]:
        """Pin `adapter_id` to a slot; returns (slot, whether its weights must be loaded there).

        `protected` adapters are not evicted even when unpinned (e.g. resident ones that waiting
        requests are about to use)."""
        slot = self._slot_of.get(adapter_id)
        needs_load = slot is None
        if needs_load:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                victim = self._lru_unpinned(protected)
                if victim is None:
                    raise RuntimeError(
                        f"all {self.num_slots} adapter slots are pinned by running requests; "
                        "the scheduler must not admit more than max_loras distinct adapters"
                    )
                slot = self._slot_of.pop(victim)
                del self._ref_cnt[victim]
                self.num_evictions += 1
            self._slot_of[adapter_id] = slot
            self._ref_cnt[adapter_id] = 0
        self._slot_of.move_to_end(adapter_id)
        self._ref_cnt[adapter_id] += 1
        return slot, needs_load

    def release(self, adapter_id: str) -> None:
        if self._ref_cnt.get(adapter_id, 0) <= 0:
            raise RuntimeError(f"adapter {adapter_id!r} released more often than acquired")
        self._ref_cnt[adapter_id] -= 1

    def evict(self, adapter_id: str) -> bool:
        """Drop an unpinned adapter (e.g. deleted); a pinned one stays until its last request ends."""
        if self._ref_cnt.get(adapter_id, 1) > 0:
            return False
        self._free_slots.append(self._slot_of.pop(adapter_id))
        del self._ref_cnt[adapter_id]
        return True

    def num_pins(self, adapter_id: str) -> int:
        """Running requests that pin the adapter's slot (0 for an unpinned or absent adapter)."""
        return self._ref_cnt.get(adapter_id, 0)

    @property
    def num_pinned(self) -> int:
        return sum(1 for count in self._ref_cnt.values() if count > 0)

    @property
    def resident(self) -> list[str]:
        return list(self._slot_of)

    def _lru_unpinned(self, protected: frozenset[str] = frozenset()) -> str | None:
        return next((a for a in self._slot_of if self._ref_cnt[a] == 0 and a not in protected), None)
