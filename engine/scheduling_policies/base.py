"""What a scheduling policy decides, and what the scheduler keeps for every policy.

The scheduler (engine/scheduler.py) owns the mechanism: the token budget, KV blocks, `max_num_seqs`,
`max_loras`, adapters still loading, chunked prefill, preemption itself. A policy answers its questions:

- the waiting queues: which queue a request waits in (`queue_key`), how queues are ordered by their
  heads (`queue_rank`), where a request joins its queue (`position`), and the order `waiting` reports;
- admission: whether it may pass over a head that lacks room (`pass_over`), or must hold the line for a
  request kept out by `max_loras` (`hold_for_slot`); whether a waiting request may preempt running ones
  (`preempts_for_admission`, `pick_victims`) and how much of a step's budget running prefills leave to
  waiting requests (`reserved_budget`);
- preemption when KV blocks run out (`pick_victim`);
- per-request bookkeeping (`forget`, when a request leaves the waiting queues for good or is admitted)
  and whether requests may carry a `priority` (`uses_priority`).

The defaults are first come, first served in one queue (vLLM's "fcfs"). Tenants' virtual token counters
(engine/fairness.py) are kept by the scheduler under every policy (usage and metrics read them); a
policy reads them only if it decides by them. Policies never touch the scheduler's state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.fairness import VirtualTokenCounters
    from engine.kv_cache import KVCacheManager
    from engine.request import Request


class SchedulingPolicy:
    """First come, first served; a policy overrides what it decides differently."""

    # Whether admission goes on once every `max_num_seqs` row is taken (to find victims for a row).
    preempts_for_admission = False
    # Whether requests may carry a non-zero `priority` (others are refused, as vLLM refuses them).
    uses_priority = False
    # Whether a running prefill leaves part of the step's budget to the waiting heads (reserved_budget).
    reserves_budget = False

    def __init__(self, config: EngineConfig, counters: VirtualTokenCounters) -> None:
        self.config = config
        self.counters = counters

    # -- the waiting queues --------------------------------------------------------------------

    def queue_key(self, request: Request) -> Hashable:
        """The waiting queue `request` waits in (FIFO within it; preempted requests at its front)."""
        return ""

    def queue_rank(self, head: Request) -> tuple:
        """Sort key of a queue by its head: admission takes the lowest first."""
        return (head.arrival_time,)

    def position(self, queue: deque[Request], request: Request, front: bool) -> int:
        """Where `request` joins `queue`: new requests at the back, preempted ones (`front`) at the front."""
        return 0 if front else len(queue)

    def admission_order(self, queues: Sequence[deque[Request]]) -> list[Request]:
        """All waiting requests in about the order admission takes them; `queues` sorted by rank."""
        return [request for queue in queues for request in queue]

    # -- admission -----------------------------------------------------------------------------

    def pass_over(self, request: Request) -> bool:
        """Whether admission may go past `request`, a head that lacks room (blocks or budget), this step.
        False: admission stops there (it cannot starve)."""
        return False

    def hold_for_slot(self, request: Request) -> bool:
        """Whether `request`, kept out by `max_loras`, now holds the line: no other adapter takes a slot
        before it and one running adapter drains. False: it is skipped (the requests behind it go on)."""
        return False

    def pick_victims(
        self,
        request: Request,
        running: Sequence[Request],
        admitted_now: Sequence[Request],
        kv: KVCacheManager,
        *,
        need_row: bool,
        num_missing_blocks: int,
    ) -> list[Request]:
        """Running requests to preempt so that waiting `request` gets a row (`need_row`) and
        `num_missing_blocks` more free blocks; [] when it may not or they cannot all be had. Never one
        admitted in this step (`admitted_now`), nor one that would wait in `request`'s own queue."""
        return []

    def reserved_budget(self, request: Request, heads: Sequence[Request]) -> int:
        """Tokens of the step's budget a running prefill leaves first to the waiting queues' `heads`."""
        return 0

    def forget(self, request: Request) -> None:
        """`request` left the waiting queues (admitted, finished or aborted): drop what is kept for it."""

    # -- preemption when KV blocks run out -----------------------------------------------------

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """The running request that gives its blocks back: the newest (the asking request may be it)."""
        return running[-1]
