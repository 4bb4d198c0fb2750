"""Which adapter occupies which GPU slot and pages: LRU among unpinned adapters, pinned while a request runs."""

from __future__ import annotations

from collections import OrderedDict

from engine.lora.pages import PageAllocator

EMPTY_SLOT = None


class SlotAllocator:
    """Maps adapter ids to `num_slots` slots and, with `num_pages`, to pages of the adapter pool.

    A slot is pinned (ref count > 0) while any running request uses its adapter and is then never
    evicted. An adapter needs a slot and its pages (engine/lora/pool.py); empty slots and free pages
    are used first, then the least recently used unpinned adapters are evicted, as few as make room.
    Without `num_pages`, pages are not tracked (every adapter needs 0).
    """

    def __init__(self, num_slots: int, num_pages: int | None = None, vocab_slots: int = 0):
        """`vocab_slots`: slots 0 .. vocab_slots - 1 have room for an adapter's own embedding and LM head
        (engine/lora/vocab.py): such adapters take only those, others take them last."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive (got {num_slots})")
        self.num_slots = num_slots
        self.vocab_slots = min(vocab_slots, num_slots)
        self.pages = PageAllocator(num_pages) if num_pages is not None else None
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU first
        self._ref_cnt: dict[str, int] = {}
        self._pages_of: dict[str, list[int]] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.num_evictions = 0

    def lookup(self, adapter_id: str) -> int | None:
        return self._slot_of.get(adapter_id)

    def pages_of(self, adapter_id: str) -> list[int]:
        """The pool pages an adapter holds, in rank order (empty without page tracking)."""
        return self._pages_of.get(adapter_id, [])

    def slot_pages(self, slot: int) -> list[int]:
        """The pages of the adapter in `slot` (empty if the slot is free)."""
        return next((self.pages_of(a) for a, s in self._slot_of.items() if s == slot), [])

    def adapter_ids(self) -> list[str]:
        """The adapters holding a slot, least recently used first."""
        return list(self._slot_of)

    def can_acquire(
        self,
        adapter_id: str,
        protected: frozenset[str] = frozenset(),
        num_pages: int = 0,
        vocab: bool = False,
    ) -> bool:
        return adapter_id in self._slot_of or self._victims(num_pages, protected, vocab) is not None

    def acquire(
        self,
        adapter_id: str,
        protected: frozenset[str] = frozenset(),
        num_pages: int = 0,
        vocab: bool = False,
    ) -> tuple[int, bool]:
        """Pin `adapter_id` to a slot (and `num_pages` pages); returns (slot, whether its weights must be
        loaded there).

        `protected` adapters are not evicted even when unpinned (e.g. resident ones that waiting
        requests are about to use)."""
        slot = self._slot_of.get(adapter_id)
        needs_load = slot is None
        if needs_load:
            victims = self._victims(num_pages, protected, vocab)
            if victims is None:
                raise RuntimeError(
                    f"no room for adapter {adapter_id!r} ({num_pages} pages): the {self.num_slots} adapter "
                    "slots or the pool's pages are pinned by running requests; the scheduler must not admit "
                    "more adapters than fit"
                )
            for victim in victims:
                self._remove(victim)
                self.num_evictions += 1
            slot = self._free_slots.pop(self._pick(vocab))
            self._slot_of[adapter_id] = slot
            self._ref_cnt[adapter_id] = 0
            if self.pages is not None:
                self._pages_of[adapter_id] = self.pages.allocate(num_pages)
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
        self._remove(adapter_id)
        return True

    def num_pins(self, adapter_id: str) -> int:
        """Running requests that pin the adapter's slot (0 for an unpinned or absent adapter)."""
        return self._ref_cnt.get(adapter_id, 0)

    @property
    def num_pinned(self) -> int:
        return sum(1 for count in self._ref_cnt.values() if count > 0)

    @property
    def num_free_pages(self) -> int | None:
        return None if self.pages is None else self.pages.num_free

    @property
    def resident(self) -> list[str]:
        return list(self._slot_of)

    def _remove(self, adapter_id: str) -> None:
        self._free_slots.append(self._slot_of.pop(adapter_id))
        del self._ref_cnt[adapter_id]
        pages = self._pages_of.pop(adapter_id, None)
        if pages is not None and self.pages is not None:
            self.pages.free(pages)

    def _pick(self, vocab: bool) -> int:
        """The index in `_free_slots` to take: the next free slot, past the vocab slots for a plain adapter
        while one is free there, among them for an adapter with its own embedding or head."""
        for i in range(len(self._free_slots) - 1, -1, -1):
            if (self._free_slots[i] < self.vocab_slots) == vocab:
                return i
        return len(self._free_slots) - 1  # a plain adapter in a vocab slot (none other is free)

    def _victims(self, num_pages: int, protected: frozenset[str], vocab: bool = False) -> list[str] | None:
        """The fewest least-recently-used unpinned, unprotected adapters whose eviction leaves a slot (a
        vocab slot for `vocab`) and `num_pages` pages free; None if even evicting all of them would not."""

        def usable(slot: int) -> bool:
            return slot < self.vocab_slots or not vocab

        free_slots = sum(1 for slot in self._free_slots if usable(slot))
        free_pages = self.pages.num_free if self.pages is not None else num_pages
        victims = []
        for adapter_id in self._slot_of:
            if free_slots >= 1 and free_pages >= num_pages:
                break
            if self._ref_cnt[adapter_id] == 0 and adapter_id not in protected:
                if free_slots >= 1 or usable(self._slot_of[adapter_id]) or free_pages < num_pages:
                    victims.append(adapter_id)
                    free_slots += usable(self._slot_of[adapter_id])
                    free_pages += len(self._pages_of.get(adapter_id, ()))
        return victims if free_slots >= 1 and free_pages >= num_pages else None
