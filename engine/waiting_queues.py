"""The scheduler's waiting requests, in the queues the scheduling policy keys them by.

Each queue is FIFO (a preempted request rejoins at its front, or where the policy places it); which
queue a request waits in and how queues are ordered by their heads are the policy's
(engine/scheduling_policies/): one queue for all under "fcfs", one per tenant under "fair", one per
priority value under "priority". Every request that joins or leaves a queue is reported to the virtual
token counters, which track who is backlogged (engine/fairness.py). A queue with no request left is
removed, so `keys()` lists exactly the queues that have candidates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

from engine.fairness import VirtualTokenCounters

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduling_policies import SchedulingPolicy


class WaitingQueues:
    def __init__(self, policy: SchedulingPolicy, counters: VirtualTokenCounters) -> None:
        self.policy = policy
        self.counters = counters
        self._queues: dict[Hashable, deque[Request]] = {}
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def keys(self) -> list[Hashable]:
        return list(self._queues)

    def queue(self, key: Hashable) -> deque[Request]:
        """Read-only for callers; take requests out with `pop` or `remove`."""
        return self._queues[key]

    def has(self, key: Hashable) -> bool:
        return key in self._queues

    def heads(self) -> list[Request]:
        """The first request of each queue."""
        return [queue[0] for queue in self._queues.values()]

    def rank(self, key: Hashable) -> tuple:
        """Sort key of a queue (the policy's, by its head): admission takes the lowest first."""
        return self.policy.queue_rank(self._queues[key][0])

    def in_admission_order(self) -> list[Request]:
        """All requests in about the order admission would take them (the policy's order)."""
        return self.policy.admission_order([self._queues[k] for k in sorted(self._queues, key=self.rank)])

    def push(self, request: Request, front: bool = False) -> None:
        """New requests join at the back; preempted ones (`front`) at the front, or where the policy says."""
        queue = self._queues.setdefault(self.key(request), deque())
        queue.insert(self.policy.position(queue, request, front), request)
        self._num_waiting += 1
        self.counters.add_waiting(request.meta.tenant, request.meta.tenant_weight)

    def pop(self, key: Hashable, index: int) -> Request:
        request = self._queues[key][index]
        del self._queues[key][index]
        self._left(key, request)
        return request

    def remove(self, request: Request) -> None:
        key = self.key(request)
        self._queues[key].remove(request)
        self._left(key, request)

    def key(self, request: Request) -> Hashable:
        """The queue `request` waits in (or would)."""
        return self.policy.queue_key(request)

    def _left(self, key: Hashable, request: Request) -> None:
        self._num_waiting -= 1
        self.counters.remove_waiting(request.meta.tenant)
        if not self._queues[key]:
            del self._queues[key]
