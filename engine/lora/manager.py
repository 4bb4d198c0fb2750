"""Tiered adapter residency: source (store, disk, folder) -> CPU tier -> GPU slot, loaded in the background.

The batch never waits for an adapter. A request's adapter is fetched and validated in the background,
whole in a loader process on CUDA or on a worker thread (engine/lora/background_loads.py), into the CPU
tier (`max_cpu_loras` rows of slot images allocated once, pinned when CUDA is present and kept as an
LRU; engine/lora/host_tier.py). Before each step, the adapters that waiting requests need are given free
or evictable GPU slots (`stage`); once the step's forward pass is launched, their copies are issued on a
side CUDA stream (`start_copies`), and the scheduler admits a request only once its adapter's copy has
completed (`is_ready`).
A slot is pinned while any running request uses it; eviction is least-recently-used among the rest and
never touches an adapter that an earlier waiting request is about to use. A load that fails fails only
the requests for that adapter, with the reason.

Each adapter has one record (engine/lora/residency.py): its status (STORED, LOADING, CPU, COPYING,
RESIDENT, PINNED, FAILED, DELETED), moved only along the transition table there, and what that status
needs. Pins (running requests; `acquire`/`release`) keep its GPU slot, holds (queued or running requests;
`hold`/`unhold`) keep its record. `retire` (replaced by a new version) and `forget` (deleted; new
requests are refused) drop its copies once the last holder finishes. That bookkeeping, and which CPU-tier
row a load may take, is engine/lora/adapter_records.py; this file starts the loads and the copies.

The waiting queue is prefetched ahead: `stage` starts the CPU-tier loads of every waiting request's
adapter, in queue order, as far as the tier has rows that no waiting adapter needs, and gives GPU slots
in the same order as far as slots free up. A row whose adapter waits for a GPU slot is never taken for a
load further back in the queue, so a deep queue cannot evict what its head is about to use.

Every method runs on the engine thread; `AdapterSource.load` runs in the background loads.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from adapter_format.errors import AdapterError
from adapter_format.events import Observer
from engine.lora.adapter_records import AdapterRecords, PendingCopy
from engine.lora.background_loads import make_loads
from engine.lora.cold_starts import ColdStart, TierHistograms
from engine.lora.host_tier import HostTier
from engine.lora.kv_tier import AdapterKVTier
from engine.lora.placements import OperatorPlacements
from engine.lora.pool import LoRAPool
from engine.lora.residency import AdapterStatus, ResidencyRecord
from engine.lora.slot_allocator import SlotAllocator
from engine.lora.slots import NEEDS_VOCAB_ROW

if TYPE_CHECKING:
    from engine.kv_cache.block_pool import BlockPool

logger = logging.getLogger(__name__)

# A failed load is remembered this long, so a burst of requests for a broken adapter fails fast while a
# transient store outage is retried soon after.
FAILURE_TTL_S = 10.0


# A GPU copy in flight: events recorded before and after it on the side stream.
_Copy = tuple[torch.cuda.Event, torch.cuda.Event]


T = TypeVar("T")


class AdapterSource(Protocol):
    """Where adapter weights come from (a folder registry, or the adapter store).

    With loads in processes, the source is pickled with each job, so it must pickle into something
    that loads the same adapters in a loader process; it may also define `drain() -> list` (called there
    after each load: what its observer and metrics saw) and `replay(records)` (called here with that
    list). engine/lora/background_loads.py."""

    def resolve(self, ref: str) -> str:
        """The adapter id for a user-facing reference; raises AdapterError if there is none. Must be fast."""

    def load(self, adapter_id: str, read: Callable[[Path], T]) -> T:
        """Bring the adapter's PEFT folder to local disk and return `read(folder)`, the folder kept in place
        until `read` returns; may be slow (runs in the background). Raises AdapterError naming the cause."""


class AdapterManager(OperatorPlacements, AdapterRecords):
    def __init__(
        self,
        source: AdapterSource,
        slots: LoRAPool,
        max_cpu_loras: int,
        observer: Observer | None = None,
        in_processes: bool = False,
        kv_cache: tuple[BlockPool, torch.Tensor, torch.Tensor] | None = None,
    ):
        """`kv_cache`: (the KV block pool, the KV cache tensor, a staging buffer) to keep adapters that
        lose their slots in idle KV blocks (engine/lora/kv_tier.py); None: no such tier."""
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be positive (got {max_cpu_loras})")
        allocator = SlotAllocator(slots.max_loras, slots.num_pages, slots.vocab_slots)
        super().__init__(allocator, max_cpu_loras, observer)
        self.source = source
        self.slots = slots
        self.max_cpu_loras = max_cpu_loras
        self._cuda = slots.device.type == "cuda"
        self.tier = HostTier(
            slots.layout,
            slots.dtype,
            max_cpu_loras,
            shared=in_processes,
            pinned=self._cuda,
            vocab_rows=slots.vocab_slots,
        )
        self.loads = make_loads(in_processes, source, self.tier)
        logger.info(
            "CPU tier: %d adapters in %.0f MiB of %shost memory; adapter loads run in loader %s",
            max_cpu_loras,
            self.tier.num_bytes / 2**20,
            "page-locked " if self._cuda else "",
            "processes" if in_processes else "threads",
        )
        self._copy_stream = torch.cuda.Stream(slots.device) if self._cuda else None
        self._to_copy: list[tuple[ResidencyRecord, int, int, PendingCopy]] = []  # (record, slot, row, ticket)
        self.cold_start_seconds = TierHistograms()  # first GPU miss -> usable on the GPU, by source tier
        self._waited = False  # the copy stream waited for the compute stream in this `stage`
        self.kv: AdapterKVTier | None = None
        if kv_cache is not None:
            self.kv = AdapterKVTier(*kv_cache, slots, self._emit)
            self.kv.on_lost = self._kv_lost
        self._init_placements()

    # -- called when a request arrives ------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        adapter_id = self.source.resolve(ref)
        record = self._records.get(adapter_id)
        if record is not None and record.deleted:
            raise AdapterError("unknown_adapter", f"adapter {ref!r} was deleted; it can no longer be used")
        return adapter_id

    def prefetch(self, adapter_id: str) -> ColdStart | None:
        """Start bringing an adapter towards the GPU; returns at once. Counts one lookup per tier.

        Returns None if it is in a GPU slot already (warm), else its cold start: one per adapter,
        shared by every request that arrives before it is usable on the GPU (and by one load)."""
        record = self._record(adapter_id)
        if record.on_gpu:
            self._emit("hit", "gpu")
            return record.cold  # None, or the cold start whose copy is still under way
        self._emit("miss", "gpu")
        in_kv = record.status is AdapterStatus.KV
        if self.kv is not None:  # then the KV tier, the CPU tier only if that missed
            self._emit("hit" if in_kv else "miss", "kv")
        if not in_kv:
            self._emit("hit" if record.in_cpu_tier else "miss", "cpu")
        if record.cold is None:
            record.cold = ColdStart("kv" if in_kv else "cpu" if record.in_cpu_tier else None)
        cold = record.cold
        self._start_load(record)
        self._forget_if_idle(record)
        return cold

    def error(self, adapter_id: str) -> str | None:
        record = self._records.get(adapter_id)
        if record is None or record.status is not AdapterStatus.FAILED:
            return None
        reason, when = record.failure
        if time.monotonic() - when > FAILURE_TTL_S:
            record.failure = None
            record.move(AdapterStatus.STORED)  # the next request retries the load
            self._forget_if_idle(record)
            return None
        return reason

    # -- called once per step, before scheduling -----------------------------------------------------

    def poll(self) -> dict[str, str]:
        """Collect finished background loads; returns {adapter id: reason} for the ones that failed."""
        failures = {}
        for adapter_id, error in self.loads.finished():
            record = self._records[adapter_id]
            origin = self.loads.origins.pop(adapter_id, None)
            if record.abandoned:
                record.abandoned = False
                self._free_row(record)
                record.move(AdapterStatus.DELETED if record.deleted else AdapterStatus.STORED)
                self._forget_if_idle(record)
            elif getattr(error, "code", None) == NEEDS_VOCAB_ROW:
                self._free_row(record)  # loaded again, into a row with room for its embedding / head
                record.needs_vocab = True
                record.move(AdapterStatus.STORED)
            elif error is None:
                self._emit("load", "source", time.perf_counter() - record.load_started)
                image = self.tier.image(record.row)
                record.rank = image.rank
                # loaded straight into a row with room for them: its slot needs that room too
                record.needs_vocab = image.owns_vocab
                record.move(AdapterStatus.CPU)
                self._touch(record)
                if record.cold is not None:  # the slowest tier it came through this cold start
                    record.cold.origin = origin or record.cold.origin
            else:
                self._free_row(record)
                failures[adapter_id] = _reason(adapter_id, error)
                record.failure, record.cold = (failures[adapter_id], time.monotonic()), None
                record.move(AdapterStatus.FAILED)
        for reason in failures.values():
            logger.warning("adapter load failed: %s", reason)
            self._emit("fail", "source")
        self._settle_placements()
        return failures

    def stage(self, wanted: Iterable[str]) -> None:
        """Bring the adapters that waiting requests need (in queue order) towards the GPU: start the
        CPU-tier loads of all of them as far as rows allow, and give those in the CPU tier or the KV tier
        GPU slots as far as slots and pool pages allow. Copies back from KV blocks are issued here (on the
        copy stream, right after the victims' saves into KV blocks); `start_copies` then issues the copies
        from CPU-tier rows, without waiting.

        An adapter already on the GPU is protected from eviction by the ones that come after it. An
        operator's placements (engine/lora/placements.py) come after every waiting request's adapter."""
        protected: set[str] = set()
        self._waited = False
        slots_left = True
        for adapter_id in dict.fromkeys([*wanted, *self.placements()]):
            if self.error(adapter_id) is not None:
                continue
            record = self._record(adapter_id)
            if record.on_gpu:
                protected.add(adapter_id)
                continue
            if record.status in (AdapterStatus.STORED, AdapterStatus.LOADING):
                self._start_load(record)  # never loaded, or dropped by the CPU tier's LRU while it waited
                self._forget_if_idle(record)
                continue
            from_kv = record.status is AdapterStatus.KV
            if not (from_kv or record.status is AdapterStatus.CPU) or not slots_left:
                continue  # failed or deleted; or no slot is left this step, but loads further back still start
            if from_kv:
                num_pages, vocab = self.kv.num_pages(adapter_id), False
            else:  # what its rank takes in the GPU pool
                num_pages, vocab = self.tier.image(record.row).num_pages, record.needs_vocab
            if not self.allocator.can_acquire(adapter_id, frozenset(protected), num_pages, vocab):
                slots_left = False  # every slot or page is in use; later adapters wait their turn too
                continue
            if record.row is not None:
                self._touch(record)
            if from_kv:
                self.kv.hold(adapter_id)  # its blocks are not lent to the victims saved below
                try:
                    slot = self._take_slot(adapter_id, frozenset(protected), num_pages, vocab)
                finally:  # never left out of the free queue
                    self.kv.release(adapter_id)
                self._restore_from_kv(record, slot)
            else:
                slot = self._take_slot(adapter_id, frozenset(protected), num_pages, vocab)
                ticket = PendingCopy()
                self._to_copy.append((record, slot, record.row, ticket))
                record.copy, self._row_reads[record.row] = ticket, ticket
                record.plain = not (record.needs_vocab or self.tier.image(record.row).use_dora)
                record.copy_tier = "cpu"
                record.move(AdapterStatus.COPYING)
            protected.add(adapter_id)
        if self._copy_stream is None:
            self.start_copies()  # on the CPU a copy is synchronous: nothing to overlap it with
        elif self._to_copy and not self._waited:
            self._copy_stream_after_compute()

    def start_copies(self) -> None:
        """Issue the slot copies that `stage` decided on. On CUDA the engine calls this right after
        launching the step's forward pass: issuing a copy costs the host a fraction of a millisecond, which
        then overlaps the GPU's work instead of delaying the launch (docs/BENCHMARKS.md, adapter loading)."""
        for record, slot, row, ticket in self._to_copy:
            copy = self._copy_into(slot, row)
            if copy is None:  # done already (CPU)
                self._row_reads.pop(row, None)
            else:
                self._row_reads[row] = copy[1]
            if record.copy is ticket:  # not evicted, dropped or restaged since
                record.copy = copy
        self._to_copy.clear()

    def is_ready(self, adapter_id: str) -> bool:
        """On the GPU and fully copied: the scheduler may admit requests for it."""
        record = self._records.get(adapter_id)
        if record is None or not record.on_gpu:
            return False
        if record.status is AdapterStatus.COPYING:
            if isinstance(record.copy, PendingCopy):
                return False
            if record.copy is not None:
                start, end = record.copy
                if not end.query():
                    return False
                self._emit("load", record.copy_tier, start.elapsed_time(end) / 1000.0)
            record.copy = None
            record.move(AdapterStatus.RESIDENT)
            self._end_cold_start(record)
        return True

    # -- called when requests start and end --------------------------------------------------------

    def acquire(self, adapter_id: str) -> int:
        """Pin a ready adapter's slot for a request that starts running."""
        if not self.is_ready(adapter_id):
            raise RuntimeError(f"adapter {adapter_id!r} is not resident; the scheduler must wait for it")
        slot, needs_load = self.allocator.acquire(adapter_id)
        assert not needs_load  # is_ready guarantees residency
        record = self._records[adapter_id]
        if record.status is AdapterStatus.RESIDENT:
            record.move(AdapterStatus.PINNED)
        return slot

    def release(self, adapter_id: str) -> None:
        """Unpin its slot for a request that stops running (finished or preempted)."""
        self.allocator.release(adapter_id)
        if self.allocator.num_pins(adapter_id) == 0:
            self._records[adapter_id].move(AdapterStatus.RESIDENT)

    # -- lifecycle --------------------------------------------------------------------------------------

    def wait_for_loads(self, timeout: float) -> None:
        """Block briefly until some background load finishes (used when nothing else can run)."""
        if self.num_loading:
            self.loads.wait(timeout)

    def shutdown(self) -> None:
        """Stop the loaders; the KV tier lets go of the KV cache (its block pool's hooks reach the tier)."""
        try:
            self.loads.close()
        finally:
            if self.kv is not None:
                self.kv.close()

    # -- internals ----------------------------------------------------------------------------------

    def _take_slot(self, adapter_id: str, protected: frozenset[str], num_pages: int, vocab: bool) -> int:
        """Give the adapter a slot and pages, unpinned until a request runs with it; the adapters evicted
        for them keep a copy in idle KV blocks where the KV tier can take one, before anything is copied
        into their pages."""
        before = {a: (self.allocator.lookup(a), self.allocator.pages_of(a)) for a in self.allocator.resident}
        slot, _ = self.allocator.acquire(adapter_id, protected, num_pages, vocab)
        self.allocator.release(adapter_id)
        for victim_id in before.keys() - set(self.allocator.resident):
            victim = self._records[victim_id]
            if self.kv is not None and victim.plain:
                if not self.kv.has(victim_id) and victim.status is not AdapterStatus.COPYING:
                    with self._on_copy_stream():
                        self.kv.save(victim_id, *before[victim_id])
                if self.kv.has(victim_id):
                    victim.copy = None
                    victim.move(AdapterStatus.KV)
                    self._emit("evict", "gpu")
                    continue
            self._lose_slot(victim)
            self._emit("evict", "gpu")
        return slot

    def _restore_from_kv(self, record: ResidencyRecord, slot: int) -> None:
        """Copy the adapter back from its KV blocks into `slot` (on the copy stream; synchronous on the CPU)."""
        pages = self.allocator.slot_pages(slot)
        record.copy_tier = "kv"
        record.move(AdapterStatus.COPYING)
        if self._copy_stream is None:
            started = time.perf_counter()
            self.kv.restore(record.adapter_id, slot, pages)
            self._emit("load", "kv", time.perf_counter() - started)
            record.copy = None
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self._on_copy_stream():
            start.record(self._copy_stream)
            self.kv.restore(record.adapter_id, slot, pages)
            end.record(self._copy_stream)
        record.copy = (start, end)

    def _on_copy_stream(self):
        """The copy stream as the current one (after it waited for the compute stream once this `stage`);
        nothing on the CPU, where copies are synchronous."""
        if self._copy_stream is None:
            return contextlib.nullcontext()
        if not self._waited:
            self._copy_stream_after_compute()
        return torch.cuda.stream(self._copy_stream)

    def _copy_stream_after_compute(self) -> None:
        # A slot may have served an earlier step whose kernels are still in flight, and a free KV block may
        # still be written by one; this step's own kernels never read a slot being filled (no request for
        # it or for its old adapter is admitted).
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.slots.device))
        self._waited = True

    def _drop(self, record: ResidencyRecord) -> None:
        """Retired or deleted, no request left: its copy in KV blocks goes with the others."""
        if self.kv is not None:
            self.kv.drop(record.adapter_id)
        super()._drop(record)

    def _kv_lost(self, adapter_id: str) -> None:
        """The KV tier's copy of the adapter was reclaimed for requests' K/V (or for another adapter)."""
        record = self._records.get(adapter_id)
        if record is not None and record.status is AdapterStatus.KV:
            record.move(AdapterStatus.CPU if record.row is not None else AdapterStatus.STORED)
            if isinstance(record.cold, ColdStart):  # a waiting cold start now comes from elsewhere
                record.cold.origin = "cpu" if record.row is not None else None
            self._forget_if_idle(record)

    def _end_cold_start(self, record: ResidencyRecord) -> None:
        """Usable on the GPU: its cold start (if a request waited for one) is over."""
        cold, record.cold = record.cold, None
        if isinstance(cold, ColdStart):
            self.cold_start_seconds.observe(cold.tier, time.monotonic() - cold.started)

    def _start_load(self, record: ResidencyRecord) -> None:
        if record.status is AdapterStatus.LOADING:
            record.abandoned = False  # wanted again: the load still running serves it
            return
        if record.status is not AdapterStatus.STORED:
            return  # a copy is local already, or it failed, or it was deleted
        row = self._take_row(record.needs_vocab)
        if row is None:
            return  # every row is being filled, copied from or waited for; `stage` tries again next step
        record.row, record.load_started = row, time.perf_counter()
        record.move(AdapterStatus.LOADING)
        self.loads.start(record.adapter_id, row)

    def _copy_into(self, slot: int, row: int) -> _Copy | None:
        image = self.tier.image(row)
        if self._copy_stream is None:
            started = time.perf_counter()
            self.slots.load(slot, image, self.allocator.slot_pages(slot))
            self._emit("load", "cpu", time.perf_counter() - started)
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._copy_stream):
            start.record(self._copy_stream)
            self.slots.load(slot, image, self.allocator.slot_pages(slot))
            end.record(self._copy_stream)
        return start, end


def _reason(adapter_id: str, error: BaseException) -> str:
    """What the adapter's requests are told. AdapterErrors are written for users; anything else is a
    bug or an environment problem whose text may carry paths or hosts, so it goes to the log only."""
    if isinstance(error, AdapterError):
        return str(error)
    logger.error("adapter %s failed to load", adapter_id, exc_info=error)
    return f"adapter {adapter_id!r} could not be loaded: an internal error (the server log has the details)"
