"""The scheduler's waiting requests: one FIFO queue per tenant ("fair") or one for all ("fcfs").

Every request that joins or leaves a queue is reported to the virtual token counters, which track who
is backlogged (engine/fairness.py). A queue with no request left is removed, so `keys()` lists exactly
the queues that have candidates.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import zip_longest

from engine.fairness import VirtualTokenCounters
from engine.request import Request

_ALL = ""  # the one queue of fcfs


class TenantQueues:
    def __init__(self, fair: bool, counters: VirtualTokenCounters) -> None:
        self.fair = fair
        self.counters = counters
        self._queues: dict[str, deque[Request]] = {}
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def keys(self) -> list[str]:
        return list(self._queues)

    def queue(self, key: str) -> deque[Request]:
        """Read-only for callers; take requests out with `pop` or `remove`."""
        return self._queues[key]

    def has(self, key: str) -> bool:
        return key in self._queues

    def heads(self) -> list[Request]:
        """The first request of each queue."""
        return [queue[0] for queue in self._queues.values()]

    def priority(self, key: str) -> tuple[float, float]:
        """Sort key of a queue: the lowest counter first, then the older head (fcfs: arrival order)."""
        head = self._queues[key][0]
        return (self.counters.counter(head.tenant) if self.fair else 0.0, head.arrival_time)

    def in_admission_order(self) -> list[Request]:
        """All requests in about the order admission would take them: queues by priority, round-robin."""
        keys = sorted(self._queues, key=self.priority)
        rows = zip_longest(*(self._queues[k] for k in keys))
        return [r for row in rows for r in row if r is not None]

    def push(self, request: Request, front: bool = False) -> None:
        """New requests join at the back; preempted ones at the front of their queue."""
        queue = self._queues.setdefault(self.key(request), deque())
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._num_waiting += 1
        self.counters.add_waiting(request.tenant, request.tenant_weight)

    def pop(self, key: str, index: int) -> Request:
        request = self._queues[key][index]
        del self._queues[key][index]
        self._left(key, request)
        return request

    def remove(self, request: Request) -> None:
        key = self.key(request)
        self._queues[key].remove(request)
        self._left(key, request)

    def key(self, request: Request) -> str:
        """The queue `request` waits in (or would)."""
        return request.tenant if self.fair else _ALL

    def _left(self, key: str, request: Request) -> None:
        self._num_waiting -= 1
        self.counters.remove_waiting(request.tenant)
        if not self._queues[key]:
            del self._queues[key]
