"""An operator's placements: adapters brought to the GPU (and pinned there) without a request.

A cluster's placement loop (`loraserve placement`, docs/OPERATIONS.md) pre-loads hot adapters on a few
replicas and lets cold ones go. On one engine that is:

- `place(id, pin)`: bring the adapter to a GPU slot as if a request waited for it, behind every real
  waiting request (`stage` walks the waiting queue's adapters first, then the placements), evicting
  only unpinned, unprotected adapters, least recently used first. With `pin`, once its copy is done its
  slot is pinned like a running request's, so it is never evicted until `unplace`.
- `unplace(id, unload)`: drop the operator's pin (the adapter stays resident, evictable, LRU), and with
  `unload` also free its slot and CPU-tier row when no request holds it.

Operator pins never take the last slot nor the pages one adapter of `max_lora_rank` needs, so requests
for other adapters always have room (a pin beyond that is refused with a warning; the adapter stays
resident, unpinned). This is part of
AdapterManager (engine/lora/manager.py); every method runs on the engine thread.
"""

from __future__ import annotations

import logging

from engine.lora.residency import AdapterStatus, ResidencyRecord

logger = logging.getLogger(__name__)


class OperatorPlacements:
    """Mixed into AdapterManager: the pending placements and the operator's pins."""

    def _init_placements(self) -> None:
        self._to_place: dict[str, bool] = {}  # adapter id -> pin it once on the GPU; in arrival order
        self._pinned_by_operator: set[str] = set()

    @property
    def operator_pins(self) -> frozenset[str]:
        return frozenset(self._pinned_by_operator)

    def placements(self) -> list[str]:
        """Adapters still to bring to the GPU for an operator (after the waiting requests' adapters)."""
        return list(self._to_place)

    def place(self, adapter_id: str, pin: bool) -> None:
        """Bring a known adapter to a GPU slot without a request; `pin`: keep it there until `unplace`."""
        record = self._record(adapter_id)
        if record.deleted:
            return
        if adapter_id in self._pinned_by_operator:
            return
        if record.status is AdapterStatus.STORED:
            self._start_load(record)  # into the CPU tier now; `stage` gives it a slot when it lands
        self._to_place[adapter_id] = pin or self._to_place.get(adapter_id, False)
        self._settle_placements()
        self._forget_if_idle(record)

    def load_to_cpu(self, adapter_id: str) -> None:
        """Start loading a known adapter into the CPU tier without a request (no lookup is counted)."""
        record = self._record(adapter_id)
        if not record.deleted:
            self._start_load(record)
        self._forget_if_idle(record)

    def unplace(self, adapter_id: str, unload: bool = False) -> None:
        """Drop the operator's pin and any pending placement; `unload`: free its slot and CPU-tier row
        too, unless a request holds it (then it stays, evictable)."""
        self._to_place.pop(adapter_id, None)
        if adapter_id in self._pinned_by_operator:
            self._pinned_by_operator.discard(adapter_id)
            self.allocator.release(adapter_id)
            if self.allocator.num_pins(adapter_id) == 0:
                self._records[adapter_id].move(AdapterStatus.RESIDENT)
        record = self._records.get(adapter_id)
        if record is not None and unload and record.holds == 0:
            self._drop(record)

    def _settle_placements(self) -> None:
        """Pin the placed adapters whose copies are done; forget the ones that failed or were deleted."""
        for adapter_id, pin in list(self._to_place.items()):
            record = self._records.get(adapter_id)
            if record is not None and (record.deleted or record.status is AdapterStatus.FAILED):
                logger.warning("adapter %s not placed: %s", adapter_id, record.failure or "deleted")
                del self._to_place[adapter_id]
            elif self.is_ready(adapter_id):
                if pin:  # without room for another pin it stays resident, unpinned (logged)
                    self._pin_for_operator(self._records[adapter_id])
                del self._to_place[adapter_id]

    def _pin_for_operator(self, record: ResidencyRecord) -> bool:
        """Pin a ready adapter's slot, if the operator's pins leave a slot and a max-rank adapter's pages."""
        pinned = self._pinned_by_operator
        if len(pinned) + 1 > self.allocator.num_slots - 1:
            logger.warning(
                "adapter %s not pinned: operator pins may hold at most %d of the %d GPU slots",
                record.adapter_id,
                self.allocator.num_slots - 1,
                self.allocator.num_slots,
            )
            return False
        pages = self.allocator.pages
        if pages is not None:
            held = sum(len(self.allocator.pages_of(a)) for a in (*pinned, record.adapter_id))
            if held > pages.num_pages - self.slots.layout.max_pages:
                logger.warning(
                    "adapter %s not pinned: operator pins would leave no room for an adapter of "
                    "max_lora_rank in the GPU pool",
                    record.adapter_id,
                )
                return False
        self.allocator.acquire(record.adapter_id)
        if record.status is AdapterStatus.RESIDENT:
            record.move(AdapterStatus.PINNED)
        pinned.add(record.adapter_id)
        return True
