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

Two counts per adapter: pins (running requests; `acquire`/`release`) keep its GPU slot, holds (queued
or running requests; `hold`/`unhold`) keep it known at all. `retire` (replaced by a new version) and
`forget` (deleted; new requests are refused) drop its copies once the last holder finishes.

Every method runs on the engine thread; `AdapterSource.load` runs in the background loads.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from engine.lora.background_loads import make_loads
from engine.lora.host_tier import HostTier
from engine.lora.peft_checkpoint import AdapterError
from engine.lora.pool import LoRAPool
from engine.lora.slot_allocator import SlotAllocator

logger = logging.getLogger(__name__)

# A failed load is remembered this long, so a burst of requests for a broken adapter fails fast while a
# transient store outage is retried soon after.
FAILURE_TTL_S = 10.0

# observer(event, tier, seconds), called on the engine thread and, by sources, on worker threads (a loader
# process's events are replayed on the engine thread):
#   "hit"/"miss"  tier "gpu", "cpu": per request arrival, whether the adapter was already in that tier
#                 (a request that misses the GPU looks in the CPU tier); tier "disk": per store load
#                 (StoreAdapterSource), whether the local disk cache held it.
#   "load"        seconds to bring an adapter from a tier: "source" (whole fetch + validation into the CPU
#                 tier), "cpu" (CPU tier -> GPU slot copy), "disk" (cached folder -> CPU tensors),
#                 "store" (download into the disk cache, checksum included).
#   "evict"       tier "gpu" (a slot reused for another adapter), "cpu" (CPU tier LRU).
#   "fail"        tier "source": a load failed (its requests fail with the reason).
Observer = Callable[[str, str, float], None]

# A GPU copy in flight: events recorded before and after it on the side stream.
_Copy = tuple[torch.cuda.Event, torch.cuda.Event]


class _Pending:
    """A copy that `stage` decided on and `start_copies` has not issued yet."""


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


class AdapterManager:
    def __init__(
        self,
        source: AdapterSource,
        slots: LoRAPool,
        max_cpu_loras: int,
        observer: Observer | None = None,
        in_processes: bool = False,
    ):
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be positive (got {max_cpu_loras})")
        self.source = source
        self.slots = slots
        self.max_cpu_loras = max_cpu_loras
        self.allocator = SlotAllocator(slots.max_loras, slots.num_pages)
        self._observer = observer
        self._cuda = slots.device.type == "cuda"
        self.tier = HostTier(slots.layout, slots.dtype, max_cpu_loras, shared=in_processes, pinned=self._cuda)
        self.loads = make_loads(in_processes, source, self.tier)
        logger.info(
            "CPU tier: %d adapters in %.0f MiB of %shost memory; adapter loads run in loader %s",
            max_cpu_loras,
            self.tier.num_bytes / 2**20,
            "page-locked " if self._cuda else "",
            "processes" if in_processes else "threads",
        )
        self._copy_stream = torch.cuda.Stream(slots.device) if self._cuda else None
        self._free_rows = list(range(max_cpu_loras))  # rows of the tier no adapter occupies
        self._cpu: OrderedDict[str, int] = OrderedDict()  # adapter id -> its row, LRU first
        self._loading: dict[str, tuple[float, int]] = {}  # id -> (start time, row it fills)
        self._abandoned: set[str] = set()  # dropped while loading: the row is freed when the load ends
        self._row_reads: dict[int, torch.cuda.Event | _Pending] = {}  # row -> the last copy out of it
        self._copies: dict[str, tuple[int, _Copy | _Pending | None]] = {}  # id -> (slot, copy not done yet)
        self._to_copy: list[tuple[str, int, int, _Pending]] = []  # (id, slot, row, ticket) for `start_copies`
        self._failed: dict[str, tuple[str, float]] = {}  # id -> (reason, when)
        self._holds: Counter[str] = Counter()  # id -> queued or running requests
        self._retiring: set[str] = set()  # dropped once their last holder finishes
        self._deleted: set[str] = set()  # never served again (ids are never reused)

    # -- called when a request arrives ------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        adapter_id = self.source.resolve(ref)
        if adapter_id in self._deleted:
            raise AdapterError("unknown_adapter", f"adapter {ref!r} was deleted; it can no longer be used")
        return adapter_id

    def prefetch(self, adapter_id: str) -> None:
        """Start bringing an adapter towards the GPU; returns at once. Counts one lookup per tier."""
        if self._resident(adapter_id):
            self._emit("hit", "gpu")
            return
        self._emit("miss", "gpu")
        self._emit("hit" if adapter_id in self._cpu else "miss", "cpu")
        self._start_load(adapter_id)

    def error(self, adapter_id: str) -> str | None:
        entry = self._failed.get(adapter_id)
        if entry is None:
            return None
        reason, when = entry
        if time.monotonic() - when > FAILURE_TTL_S:
            del self._failed[adapter_id]
            return None
        return reason

    def hold(self, adapter_id: str) -> None:
        """A request for this adapter was queued; it keeps the adapter's copies until `unhold`."""
        self._holds[adapter_id] += 1

    def unhold(self, adapter_id: str) -> None:
        """A request for this adapter finished (or failed, or was aborted)."""
        if self._holds[adapter_id] <= 0:
            raise RuntimeError(f"adapter {adapter_id!r} unheld more often than held")
        self._holds[adapter_id] -= 1
        if self._holds[adapter_id] == 0:
            del self._holds[adapter_id]
            if adapter_id in self._retiring:
                self._drop(adapter_id)

    # -- called once per step, before scheduling -----------------------------------------------------

    def poll(self) -> dict[str, str]:
        """Collect finished background loads; returns {adapter id: reason} for the ones that failed."""
        failures = {}
        for adapter_id, error in self.loads.finished():
            started, row = self._loading.pop(adapter_id)
            if adapter_id in self._abandoned:
                self._abandoned.discard(adapter_id)
                self._free_rows.append(row)
            elif error is None:
                self._emit("load", "source", time.perf_counter() - started)
                self._cpu[adapter_id] = row
            else:
                self._free_rows.append(row)
                failures[adapter_id] = _reason(adapter_id, error)
        for adapter_id, reason in failures.items():
            logger.warning("adapter load failed: %s", reason)
            self._emit("fail", "source")
            self._failed[adapter_id] = (reason, time.monotonic())
        return failures

    def stage(self, wanted: Iterable[str]) -> None:
        """Give the adapters waiting requests need (in queue order) GPU slots; `start_copies` then copies
        them in, without waiting.

        An adapter already resident is protected from eviction by the ones that come after it."""
        protected: set[str] = set()
        waited = self._copy_stream is None
        for adapter_id in dict.fromkeys(wanted):
            if self._resident(adapter_id):
                protected.add(adapter_id)
                continue
            row = self._cpu.get(adapter_id)
            if row is None:
                if self.error(adapter_id) is None:
                    self._start_load(adapter_id)  # e.g. dropped by the CPU tier's LRU while it waited
                continue
            num_pages = self.tier.image(row).num_pages  # what its rank takes in the GPU pool
            if not self.allocator.can_acquire(adapter_id, frozenset(protected), num_pages):
                break  # every slot or page is in use; later adapters wait their turn too
            self._cpu.move_to_end(adapter_id)
            before = set(self.allocator.resident)
            slot, _ = self.allocator.acquire(adapter_id, frozenset(protected), num_pages)
            self.allocator.release(adapter_id)  # resident but unpinned until a request runs with it
            for victim in before - set(self.allocator.resident):
                self._copies.pop(victim, None)
                self._emit("evict", "gpu")
            if not waited:
                # The slot may have served an earlier step whose kernels are still in flight; this step's
                # own kernels never read it (no request for it or for its old adapter is admitted).
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.slots.device))
                waited = True
            ticket = _Pending()
            self._to_copy.append((adapter_id, slot, row, ticket))
            self._copies[adapter_id], self._row_reads[row] = (slot, ticket), ticket
            protected.add(adapter_id)
        if self._copy_stream is None:
            self.start_copies()  # on the CPU a copy is synchronous: nothing to overlap it with

    def start_copies(self) -> None:
        """Issue the slot copies that `stage` decided on. On CUDA the engine calls this right after
        launching the step's forward pass: issuing a copy costs the host a fraction of a millisecond, which
        then overlaps the GPU's work instead of delaying the launch (docs/BENCHMARKS.md, adapter loading)."""
        for adapter_id, slot, row, ticket in self._to_copy:
            copy = self._copy_into(slot, row)
            if copy is None:  # done already (CPU)
                self._row_reads.pop(row, None)
            else:
                self._row_reads[row] = copy[1]
            if self._copies.get(adapter_id) == (slot, ticket):  # not evicted, dropped or restaged since
                self._copies[adapter_id] = (slot, copy)
        self._to_copy.clear()

    def is_ready(self, adapter_id: str) -> bool:
        """Resident and fully copied: the scheduler may admit requests for it."""
        if not self._resident(adapter_id):
            return False
        slot, copy = self._copies[adapter_id]
        if isinstance(copy, _Pending):
            return False
        if copy is not None:
            start, end = copy
            if not end.query():
                return False
            self._emit("load", "cpu", start.elapsed_time(end) / 1000.0)
            self._copies[adapter_id] = (slot, None)
        return True

    # -- called when requests start and end --------------------------------------------------------

    def acquire(self, adapter_id: str) -> int:
        """Pin a ready adapter's slot for a request that starts running."""
        if not self.is_ready(adapter_id):
            raise RuntimeError(f"adapter {adapter_id!r} is not resident; the scheduler must wait for it")
        slot, needs_load = self.allocator.acquire(adapter_id)
        assert not needs_load  # is_ready guarantees residency
        return slot

    def release(self, adapter_id: str) -> None:
        self.allocator.release(adapter_id)

    def retire(self, adapter_id: str) -> None:
        """A newer version replaced it: drop its copies, and free its slot, once no request holds it."""
        self._retiring.add(adapter_id)
        if self._holds.get(adapter_id, 0) == 0:
            self._drop(adapter_id)

    def forget(self, adapter_id: str) -> None:
        """It was deleted: refuse new requests for it (`resolve`), then retire it."""
        self._deleted.add(adapter_id)
        self.retire(adapter_id)

    # -- introspection for metrics ---------------------------------------------------------------

    @property
    def num_slots_in_use(self) -> int:
        return self.allocator.num_pinned

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self.allocator.adapter_ids()))

    def cpu_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._cpu))

    def resident_ids(self) -> frozenset[str]:
        """Adapters in the CPU tier or a GPU slot (a slot's adapter may have left the CPU tier's LRU)."""
        return frozenset(self._cpu).union(self.allocator.adapter_ids())

    def wait_for_loads(self, timeout: float) -> None:
        """Block briefly until some background load finishes (used when nothing else can run)."""
        if self._loading:
            self.loads.wait(timeout)

    def shutdown(self) -> None:
        self.loads.close()

    # -- internals ----------------------------------------------------------------------------------

    def _resident(self, adapter_id: str) -> bool:
        entry = self._copies.get(adapter_id)
        return entry is not None and self.allocator.lookup(adapter_id) == entry[0]

    def _start_load(self, adapter_id: str) -> None:
        if adapter_id in self._loading:
            self._abandoned.discard(adapter_id)  # wanted again: the load still running serves it
            return
        if adapter_id in self._cpu or self._resident(adapter_id):
            return
        row = self._take_row()
        if row is None:
            return  # every row is being filled or copied from; `stage` tries again next step
        self._loading[adapter_id] = (time.perf_counter(), row)
        self.loads.start(adapter_id, row)

    def _take_row(self) -> int | None:
        """A row to load into: a free one, else the least recently used adapter's, never one that a GPU
        copy still reads."""
        for i, row in enumerate(self._free_rows):
            if self._row_writable(row):
                return self._free_rows.pop(i)
        for adapter_id, row in self._cpu.items():
            if self._row_writable(row):
                del self._cpu[adapter_id]
                self._emit("evict", "cpu")
                return row
        return None

    def _row_writable(self, row: int) -> bool:
        copy_end = self._row_reads.get(row)
        if isinstance(copy_end, _Pending) or (copy_end is not None and not copy_end.query()):
            return False
        self._row_reads.pop(row, None)
        return True

    def _drop(self, adapter_id: str) -> None:
        """No request holds it any more: free everything it occupies (its slot is unpinned by now)."""
        self._retiring.discard(adapter_id)
        row = self._cpu.pop(adapter_id, None)
        if row is not None:
            self._free_rows.append(row)
        self._failed.pop(adapter_id, None)
        if adapter_id in self._loading:
            self._abandoned.add(adapter_id)  # it still writes its row; `poll` frees the row when it ends
        if self.allocator.evict(adapter_id):
            self._copies.pop(adapter_id, None)

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

    def _emit(self, event: str, tier: str, seconds: float = 0.0) -> None:
        emit(self._observer, event, tier, seconds)


def _reason(adapter_id: str, error: BaseException) -> str:
    """What the adapter's requests are told. AdapterErrors are written for users; anything else is a
    bug or an environment problem whose text may carry paths or hosts, so it goes to the log only."""
    if isinstance(error, AdapterError):
        return str(error)
    logger.error("adapter %s failed to load", adapter_id, exc_info=error)
    return f"adapter {adapter_id!r} could not be loaded: an internal error (the server log has the details)"


def emit(observer: Observer | None, event: str, tier: str, seconds: float = 0.0) -> None:
    """Call an observer; a broken metrics hook is logged, never allowed to stop serving."""
    if observer is None:
        return
    try:
        observer(event, tier, seconds)
    except Exception:
        logger.exception("adapter observer failed on (%s, %s)", event, tier)
