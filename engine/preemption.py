"""Preemption: which running request gives way when KV blocks run out, and how it goes back to waiting.

A preempted request loses its blocks and its speculative proposals, waits at the head of its queue (or
where the policy places it) and is recomputed from token 0 when admission reaches it again. Which
running request gives way when blocks run out is the scheduling policy's choice (`pick_victim`: the
newest under "fcfs"; the newest of the tenant most over its share under "fair"; the worst priority under
"priority"); so are the preemptions that make room for a waiting request (`pick_victims`), carried out
here.
"""

from __future__ import annotations

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest
from engine.waiting_queues import WaitingQueues


class Preemptor:
    def __init__(self, kv_cache_manager: KVCacheManager, queues: WaitingQueues) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.queues = queues
        self.num_preemptions = 0  # cumulative, for metrics
        # The part of them that made room for a waiting request (fair: a tenant below its share;
        # priority: a better priority) rather than for a running one's blocks.
        self.num_admission_preemptions = 0

    def preempt(self, request: Request) -> None:
        """Free a request's blocks and put it back in its queue (it is no longer running)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.queues.push(request, front=True)

    def preempt_for_admission(
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
            self.num_admission_preemptions += 1
        return budget
