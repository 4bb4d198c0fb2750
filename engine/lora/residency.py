"""One residency record per adapter the manager knows: an explicit status, every legal transition in one table.

The status says how close to the GPU the adapter is; the other fields hold what that status needs (the
CPU-tier row, the GPU slot's copy) and the request counts that keep it known.

The way in, one step at a time (TRANSITIONS below lists every move, evictions, failures and drops too):

    STORED --load--> LOADING --loaded--> CPU --given a slot--> COPYING --copied--> RESIDENT <--> PINNED

and, with the KV tier (engine/lora/kv_tier.py), the way back to the GPU from idle KV blocks:

    RESIDENT --slot evicted, a copy kept in KV blocks--> KV --given a slot--> COPYING --> RESIDENT

An adapter's CPU-tier row may outlive the move to the GPU (`row` stays set while the row is not reused),
so `status` is the closest tier and `row` says whether the CPU tier also holds it. DELETED is final: a
deleted id is never served again (ids are never reused).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AdapterStatus(enum.Enum):
    STORED = "stored"  # known; its weights are only at the source (store, disk cache, local folder)
    LOADING = "loading"  # a background load is writing its CPU-tier row
    CPU = "cpu"  # in a CPU-tier row, not on the GPU
    KV = "kv"  # a copy in idle KV-cache blocks on the GPU, not in a slot (may also keep a CPU-tier row)
    COPYING = (
        "copying"  # given a GPU slot; the copy from its CPU-tier row or its KV blocks is pending or in flight
    )
    RESIDENT = "resident"  # in a GPU slot, copied, no running request: evictable (LRU)
    PINNED = "pinned"  # in a GPU slot, used by running requests: never evicted
    FAILED = "failed"  # its last load failed: its requests fail fast until the failure expires
    DELETED = "deleted"  # deleted: refused from now on (final)


S = AdapterStatus
# status -> the statuses it may move to. Dropping an adapter (retired or deleted, no request left) moves
# it to STORED or DELETED from wherever it is, except LOADING (its row is written until the load ends)
# and PINNED (a running request still uses it, so it is never dropped).
TRANSITIONS: dict[AdapterStatus, frozenset[AdapterStatus]] = {
    S.STORED: frozenset({S.LOADING, S.DELETED}),
    # a load dropped half-way ends in STORED (or DELETED) once it finishes writing its row
    S.LOADING: frozenset({S.CPU, S.FAILED, S.STORED, S.DELETED}),
    # STORED: its row was reused by the CPU tier's LRU, or it was dropped
    S.CPU: frozenset({S.COPYING, S.STORED, S.DELETED}),
    # COPYING: given a slot, copied back from its blocks; CPU or STORED: the blocks were reclaimed for
    # requests' K/V (with or without a row left in the CPU tier), or it was dropped
    S.KV: frozenset({S.COPYING, S.CPU, S.STORED, S.DELETED}),
    # CPU or KV: its slot went to another adapter before the copy completed (KV: its blocks still hold it)
    S.COPYING: frozenset({S.RESIDENT, S.KV, S.CPU, S.STORED, S.DELETED}),
    # CPU, KV or STORED: its slot was evicted, with a copy left in KV blocks or the CPU tier, or none
    S.RESIDENT: frozenset({S.PINNED, S.KV, S.CPU, S.STORED, S.DELETED}),
    S.PINNED: frozenset({S.RESIDENT}),
    # STORED: the failure expired (the next request retries) or the adapter was dropped
    S.FAILED: frozenset({S.STORED, S.DELETED}),
    S.DELETED: frozenset(),
}
ON_GPU = frozenset({S.COPYING, S.RESIDENT, S.PINNED})  # holds a GPU slot


class IllegalTransition(RuntimeError):
    """A move the table does not allow: a bug in the manager, never a user error."""


@dataclass(eq=False)
class ResidencyRecord:
    adapter_id: str
    status: AdapterStatus = AdapterStatus.STORED
    row: int | None = None  # its CPU-tier row (being written while LOADING), or None
    cpu_used: int = 0  # when its row was last used (the manager's tick): the CPU tier evicts the lowest
    load_started: float = 0.0  # perf_counter() when the current load began (LOADING)
    # The GPU copy while COPYING: a ticket until `start_copies` issues it, then its (start, end) events
    # (None on the CPU, where copies are synchronous). Set by the manager.
    copy: object = None
    failure: tuple[str, float] | None = None  # (reason, monotonic time) while FAILED
    rank: int = 0  # its largest rank, known once a load completed (for the residency metrics)
    holds: int = 0  # queued or running requests: the record is kept while any is left
    retiring: bool = False  # replaced or deleted: dropped once `holds` reaches 0
    deleted: bool = False  # refused from now on; DELETED once dropped
    abandoned: bool = False  # dropped while LOADING: the row is freed when the load ends
    # It has its own embedding or LM head (a load said so): only rows and slots with room for them hold it.
    needs_vocab: bool = False
    # From the first request that missed the GPU until the adapter is usable there (cold_starts.py).
    cold: object = None
    # A plain adapter (no DoRA, no own embedding or head): the KV tier may keep a copy of its slot.
    plain: bool = False
    # Where the copy into its slot comes from while COPYING: "cpu" (its row) or "kv" (its KV blocks).
    copy_tier: str = "cpu"

    def move(self, status: AdapterStatus) -> None:
        """Change status, refusing any move the transition table does not list."""
        if status not in TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"adapter {self.adapter_id!r}: {self.status.name} -> {status.name} is not a legal transition"
            )
        self.status = status

    @property
    def on_gpu(self) -> bool:
        return self.status in ON_GPU

    @property
    def in_cpu_tier(self) -> bool:
        """A complete copy sits in its CPU-tier row."""
        return self.row is not None and self.status is not AdapterStatus.LOADING

    @property
    def waits_in_cpu_tier(self) -> bool:
        """Requests wait for it off the GPU's slots: its row must not be reused (a copy in KV blocks may be
        reclaimed any step, so the row is kept as well)."""
        return self.status in (AdapterStatus.CPU, AdapterStatus.KV) and self.holds > 0

    @property
    def idle(self) -> bool:
        """Nothing local and nobody waiting: the record may be forgotten."""
        return self.status is AdapterStatus.STORED and self.holds == 0 and not self.deleted
