"""Preemption: which running request gives way when KV blocks run out, and how it goes back to waiting.

A preempted request loses its blocks and its speculative proposals, waits at the head of its queue and
is recomputed from token 0 when admission reaches it again. When blocks run out, the victim under the
"fair" policy is the newest running request of the tenant with the highest virtual token counter (the
one most over its share), under "fcfs" the newest overall. The fair scheduler's other preemptions, that
make room for a tenant below its share, are chosen by engine/fair_preemption.py and carried out here.
"""

from __future__ import annotations

from engine.fairness import VirtualTokenCounters
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest
from engine.tenant_queues import TenantQueues


class Preemptor:
    def __init__(
        self,
        fair: bool,
        counters: VirtualTokenCounters,
        kv_cache_manager: KVCacheManager,
        queues: TenantQueues,
    ) -> None:
        self.fair = fair
        self.counters = counters
        self.kv_cache_manager = kv_cache_manager
        self.queues = queues
        self.num_preemptions = 0  # cumulative, for metrics
        self.num_fairness_preemptions = 0  # the part of them that made room for a tenant below its share

    def pick_victim(self, running: list[Request]) -> Request:
        """The newest running request of the tenant with the highest counter ("fcfs": the newest)."""
        if not self.fair:
            return running[-1]
        victim, highest = None, 0.0
        for request in reversed(running):
            counter = self.counters.counter(request.tenant)
            if victim is None or counter > highest:
                victim, highest = request, counter
        return victim

    def preempt(self, request: Request) -> None:
        """Free a request's blocks and put it back at the head of its queue (it is no longer running)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.queues.push(request, front=True)

    def preempt_for_fairness(
        self,
        victims: list[Request],
        running: list[Request],
        scheduled: list[ScheduledRequest],
        preempted: list[Request],
        budget: int,
    ) -> int:
        """Preempt `victims` during admission; those scheduled earlier in this step give back their
        tokens (nothing has run yet). Returns the budget."""
        for victim in victims:
            running.remove(victim)
            item = next((s for s in scheduled if s.request is victim), None)
            if item is not None:
                scheduled.remove(item)
                budget += item.num_new_tokens
            self.preempt(victim)
            preempted.append(victim)
            self.num_fairness_preemptions += 1
        return budget
