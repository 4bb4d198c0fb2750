"""`priority`: vLLM's priority scheduling. Each request carries an integer `priority` (RequestMeta;
default 0): lower values are served first, ties by arrival time.

The waiting requests form one queue per priority value, each in arrival order (a preempted request
goes back to its place by arrival), and admission takes the best one first; a head that lacks room
stops admission, as under fcfs. When KV blocks run out, the running request with the worst priority
(the highest value, then the latest arrival) is preempted. A waiting request that lacks a row or
blocks preempts running requests of a strictly worse priority for them, worst first, and only if that
frees enough (as vLLM's priority scheduling does); equal priorities never preempt each other.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from engine.scheduling_policies.base import SchedulingPolicy

if TYPE_CHECKING:
    from engine.kv_cache import KVCacheManager
    from engine.request import Request


def _rank(request: Request) -> tuple[int, float]:
    """Lower is better: (priority, arrival time)."""
    return (request.meta.priority, request.arrival_time)


class PriorityPolicy(SchedulingPolicy):
    preempts_for_admission = True
    uses_priority = True

    def queue_key(self, request: Request) -> Hashable:
        return request.meta.priority

    def queue_rank(self, head: Request) -> tuple:
        return _rank(head)

    def position(self, queue: deque[Request], request: Request, front: bool) -> int:
        """By arrival within the priority: a preempted request goes back ahead of later arrivals."""
        return bisect_right(queue, request.arrival_time, key=lambda r: r.arrival_time)

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
        new_ids = {r.request_id for r in admitted_now}
        candidates = sorted(
            (
                r
                for r in running
                if r.meta.priority > request.meta.priority
                and r.request_id not in new_ids
                and not kv.shares_unwritten_blocks(r)  # its K/V for this step must still be written
            ),
            key=_rank,
            reverse=True,
        )
        victims: list[Request] = []
        num_freed = 0
        for victim in candidates:
            if (not need_row or victims) and num_freed >= num_missing_blocks:
                break
            victims.append(victim)
            num_freed += kv.num_freeable_blocks(victim)
        if (need_row and not victims) or num_freed < num_missing_blocks:
            return []  # not enough to be had: nobody is preempted
        return victims

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_rank)
