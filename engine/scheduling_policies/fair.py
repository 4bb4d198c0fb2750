"""`fair`: tenants share the engine by weight (virtual token counters, engine/fairness.py).

One FIFO queue per tenant; admission takes the head of the queue whose tenant has the lowest counter.
A head that lacks room, or an adapter slot, is passed over for at most `fairness_max_bypass_steps`
steps (work conservation without starvation); after that it holds the line. A request that finds the
batch full preempts requests of a tenant far over its share, and running prefills leave the step's
budget first to the heads of tenants not above them (both rules in engine/fair_preemption.py). When KV
blocks run out, the newest running request of the tenant with the highest counter gives way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from itertools import zip_longest
from typing import TYPE_CHECKING

from engine import fair_preemption
from engine.scheduling_policies.base import SchedulingPolicy

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.fairness import VirtualTokenCounters
    from engine.kv_cache import KVCacheManager
    from engine.request import Request


class FairPolicy(SchedulingPolicy):
    preempts_for_admission = True
    reserves_budget = True

    def __init__(self, config: EngineConfig, counters: VirtualTokenCounters) -> None:
        super().__init__(config, counters)
        self._bypassed: dict[str, int] = {}  # request id -> steps admission went past it

    def queue_key(self, request: Request) -> Hashable:
        return request.meta.tenant

    def queue_rank(self, head: Request) -> tuple:
        return (self.counters.counter(head.meta.tenant), head.arrival_time)

    def admission_order(self, queues: Sequence[deque[Request]]) -> list[Request]:
        """Round-robin over the tenants' queues, lowest counter first."""
        return [request for row in zip_longest(*queues) for request in row if request is not None]

    def pass_over(self, request: Request) -> bool:
        return self._may_bypass(request)

    def hold_for_slot(self, request: Request) -> bool:
        return not self._may_bypass(request)

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
        return fair_preemption.pick_victims(
            request,
            running,
            admitted_now,
            self.counters,
            kv,
            need_row=need_row,
            num_missing_blocks=num_missing_blocks,
        )

    def reserved_budget(self, request: Request, heads: Sequence[Request]) -> int:
        return fair_preemption.reserved_budget(request.meta.tenant, heads, self.counters)

    def forget(self, request: Request) -> None:
        self._bypassed.pop(request.request_id, None)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """The newest running request of the tenant with the highest counter (the most over its share)."""
        victim, highest = None, 0.0
        for request in reversed(running):
            counter = self.counters.counter(request.meta.tenant)
            if victim is None or counter > highest:
                victim, highest = request, counter
        return victim

    def _may_bypass(self, request: Request) -> bool:
        """Whether admission may go past `request` once more; counts the steps it did."""
        count = self._bypassed.get(request.request_id, 0)
        if count >= self.config.fairness_max_bypass_steps:
            return False
        self._bypassed[request.request_id] = count + 1
        return True
