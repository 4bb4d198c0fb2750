"""The adapter manager's bookkeeping: one record per adapter, the CPU tier's rows, what frees them.

Each adapter the manager knows has one record (engine/lora/residency.py): its status, moved only along
the transition table there, and what that status needs. Holds (queued or running requests; `hold` /
`unhold`) keep its record; pins (running requests, counted by the slot allocator) keep its GPU slot.
`retire` (replaced by a new version) and `forget` (deleted) drop its copies once the last holder
finishes. A record with nothing local and no request is forgotten.

The CPU tier's rows are handed out here: a free row, else the least recently used adapter's, never one
that a GPU copy still reads nor one whose adapter waits in the CPU tier for a GPU slot.

AdapterManager (engine/lora/manager.py) builds on this with the loads and copies that move adapters
between tiers; nothing here starts a load or a copy. Every method runs on the engine thread.
"""

from __future__ import annotations

import torch

from adapter_format.events import Observer, emit
from engine.lora.residency import AdapterStatus, ResidencyRecord
from engine.lora.slot_allocator import SlotAllocator
from engine.stats import AdapterResidency


class PendingCopy:
    """A copy that `stage` decided on and `start_copies` has not issued yet."""


class AdapterRecords:
    def __init__(self, allocator: SlotAllocator, max_cpu_loras: int, observer: Observer | None) -> None:
        self.allocator = allocator
        self._observer = observer
        self._records: dict[str, ResidencyRecord] = {}  # every adapter known: held, local, failed or deleted
        self._free_rows = list(range(max_cpu_loras))  # rows of the tier no adapter occupies
        # rows 0 .. this - 1 have room for an adapter's own embedding and LM head, as its slots do
        self._vocab_rows = allocator.vocab_slots
        self._row_reads: dict[int, torch.cuda.Event | PendingCopy] = {}  # row -> the last copy out of it
        self._tick = 0  # counts uses of CPU-tier rows: their LRU order

    # -- holds and drops ----------------------------------------------------------------------------

    def hold(self, adapter_id: str) -> None:
        """A request for this adapter was queued; it keeps the adapter's copies until `unhold`."""
        self._record(adapter_id).holds += 1

    def unhold(self, adapter_id: str) -> None:
        """A request for this adapter finished (or failed, or was aborted)."""
        record = self._records.get(adapter_id)
        if record is None or record.holds <= 0:
            raise RuntimeError(f"adapter {adapter_id!r} unheld more often than held")
        record.holds -= 1
        if record.holds == 0:
            if record.retiring:
                self._drop(record)
            else:
                self._forget_if_idle(record)

    def retire(self, adapter_id: str) -> None:
        """A newer version replaced it: drop its copies, and free its slot, once no request holds it."""
        self.unplace(adapter_id)
        record = self._records.get(adapter_id)
        if record is None:
            return  # nothing of it is held here
        record.retiring = True
        if record.holds == 0:
            self._drop(record)

    def forget(self, adapter_id: str) -> None:
        """It was deleted: refuse new requests for it (`resolve`), then retire it."""
        self.unplace(adapter_id)
        record = self._record(adapter_id)
        record.deleted = record.retiring = True
        if record.holds == 0:
            self._drop(record)

    # -- introspection for metrics and tests --------------------------------------------------------

    def status(self, adapter_id: str) -> AdapterStatus | None:
        """The adapter's status, or None for one the manager does not know (nothing of it is held)."""
        record = self._records.get(adapter_id)
        return None if record is None else record.status

    @property
    def num_slots_in_use(self) -> int:
        return self.allocator.num_pinned

    @property
    def num_loading(self) -> int:
        return sum(1 for r in self._records.values() if r.status is AdapterStatus.LOADING)

    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(sorted(r.adapter_id for r in self._records.values() if r.on_gpu))

    def cpu_ids(self) -> tuple[str, ...]:
        return tuple(sorted(r.adapter_id for r in self._records.values() if r.in_cpu_tier))

    def residency(self) -> tuple[AdapterResidency, ...]:
        """Every adapter in a GPU slot or the CPU tier, by id: its closest tier, pins and rank."""
        placed = self.operator_pins
        return tuple(
            AdapterResidency(
                adapter_id=r.adapter_id,
                level="gpu" if r.on_gpu else "cpu",
                pinned=r.status is AdapterStatus.PINNED,
                rank=r.rank,
                placed=r.adapter_id in placed,
                in_cpu_tier=r.in_cpu_tier,
            )
            for r in sorted(self._records.values(), key=lambda r: r.adapter_id)
            if r.on_gpu or r.in_cpu_tier
        )

    @property
    def operator_pins(self) -> frozenset[str]:
        """Adapters an operator pinned to the GPU (engine/lora/placements.py); none here."""
        return frozenset()

    def unplace(self, adapter_id: str, unload: bool = False) -> None:
        """Drop an operator's placement of it (engine/lora/placements.py); nothing to drop here."""

    def resident_ids(self) -> frozenset[str]:
        """Adapters in the CPU tier, a GPU slot or KV blocks (a slot's adapter may have left the CPU tier's
        LRU)."""
        return frozenset(
            r.adapter_id
            for r in self._records.values()
            if r.in_cpu_tier or r.on_gpu or r.status is AdapterStatus.KV
        )

    # -- records ------------------------------------------------------------------------------------

    def _record(self, adapter_id: str) -> ResidencyRecord:
        record = self._records.get(adapter_id)
        if record is None:
            record = self._records[adapter_id] = ResidencyRecord(adapter_id)
        return record

    def _forget_if_idle(self, record: ResidencyRecord) -> None:
        """Nothing local and nobody waiting: the record carries nothing worth keeping."""
        if record.idle and self._records.get(record.adapter_id) is record:
            del self._records[record.adapter_id]

    def _lose_slot(self, record: ResidencyRecord) -> None:
        """Its slot went to another adapter (the allocator already took it)."""
        record.copy = None
        record.move(AdapterStatus.CPU if record.row is not None else AdapterStatus.STORED)
        self._forget_if_idle(record)

    def _drop(self, record: ResidencyRecord) -> None:
        """No request holds it any more: free everything it occupies (its slot is unpinned by now)."""
        record.retiring, record.failure = False, None
        if record.status is AdapterStatus.LOADING:
            record.abandoned = True  # it still writes its row; `poll` frees the row when it ends
            return
        if record.on_gpu:
            evicted = self.allocator.evict(record.adapter_id)
            assert evicted, "a dropped adapter has no running request, so its slot is unpinned"
            record.copy = None
        self._free_row(record)
        final = AdapterStatus.DELETED if record.deleted else AdapterStatus.STORED
        if record.status is not final:
            record.move(final)
        self._forget_if_idle(record)

    # -- CPU-tier rows ------------------------------------------------------------------------------

    def _touch(self, record: ResidencyRecord) -> None:
        self._tick += 1
        record.cpu_used = self._tick

    def _take_row(self, vocab: bool = False) -> int | None:
        """A row to load into: a free one, else the least recently used adapter's, never one that a GPU
        copy still reads nor one whose adapter waits in the CPU tier for a GPU slot. `vocab`: a row with
        room for an adapter's own embedding and LM head (rows below `vocab_rows`), which others take last."""
        vocab_rows = self._vocab_rows
        order = sorted(range(len(self._free_rows)), key=lambda i: (self._free_rows[i] < vocab_rows) != vocab)
        for i in order:
            row = self._free_rows[i]
            if (row < vocab_rows or not vocab) and self._row_writable(row):
                return self._free_rows.pop(i)
        candidates = [
            r
            for r in self._records.values()
            if r.in_cpu_tier and not r.waits_in_cpu_tier and (r.row < vocab_rows or not vocab)
        ]
        for victim in sorted(candidates, key=lambda r: r.cpu_used):
            if self._row_writable(victim.row):
                row, victim.row = victim.row, None
                if victim.status is AdapterStatus.CPU:
                    victim.move(AdapterStatus.STORED)
                self._emit("evict", "cpu")
                self._forget_if_idle(victim)
                return row
        return None

    def _row_writable(self, row: int) -> bool:
        copy_end = self._row_reads.get(row)
        if isinstance(copy_end, PendingCopy) or (copy_end is not None and not copy_end.query()):
            return False
        self._row_reads.pop(row, None)
        return True

    def _free_row(self, record: ResidencyRecord) -> None:
        if record.row is not None:
            self._free_rows.append(record.row)
            record.row = None

    def _emit(self, event: str, tier: str, seconds: float = 0.0) -> None:
        emit(self._observer, event, tier, seconds)
