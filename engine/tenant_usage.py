"""Per-tenant accounting of what the scheduler served: tokens, queue time and recent share."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.request import Request
from engine.stats import TenantStats

# Time constant of the exponentially decaying service behind `share`: about the last minute.
SHARE_WINDOW_S = 60.0


@dataclass
class _Usage:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    queue_time_s: float = 0.0
    recent_cost: float = 0.0  # weighted tokens, decayed to `updated`
    updated: float = 0.0


class TenantLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def admitted(self, request: Request, cost: float) -> None:
        """`request` was admitted for the first time; `cost` is its weighted prompt cost."""
        usage = self._add(request.meta.tenant, cost)
        usage.num_requests += 1
        usage.num_prompt_tokens += request.num_prompt_tokens
        usage.queue_time_s += max(0.0, self._clock() - request.arrival_time)

    def generated(self, tenant: str, num_tokens: int, cost: float) -> None:
        self._add(tenant, cost).num_generation_tokens += num_tokens

    def stats(
        self,
        counters: dict[str, float],
        weights: Callable[[str], float],
        running: Iterable[Request],
        waiting: Iterable[Request],
    ) -> tuple[TenantStats, ...]:
        now = self._clock()
        num_running = _count(running)
        num_waiting = _count(waiting)
        tenants = sorted(set(self._usage) | set(num_running) | set(num_waiting))
        recent = {t: self._decayed(self._usage[t], now) if t in self._usage else 0.0 for t in tenants}
        total = sum(recent.values())
        result = []
        for tenant in tenants:
            usage = self._usage.get(tenant, _Usage())
            result.append(
                TenantStats(
                    tenant=tenant,
                    weight=weights(tenant),
                    num_requests=usage.num_requests,
                    num_prompt_tokens=usage.num_prompt_tokens,
                    num_generation_tokens=usage.num_generation_tokens,
                    queue_time_s=usage.queue_time_s,
                    virtual_tokens=counters.get(tenant, 0.0),
                    share=recent[tenant] / total if total > 0 else 0.0,
                    num_running=num_running.get(tenant, 0),
                    num_waiting=num_waiting.get(tenant, 0),
                )
            )
        return tuple(result)

    def _add(self, tenant: str, cost: float) -> _Usage:
        now = self._clock()
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage(updated=now)
        usage.recent_cost = self._decayed(usage, now) + cost
        usage.updated = now
        return usage

    @staticmethod
    def _decayed(usage: _Usage, now: float) -> float:
        return usage.recent_cost * math.exp(-max(0.0, now - usage.updated) / SHARE_WINDOW_S)


def _count(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        counts[request.meta.tenant] = counts.get(request.meta.tenant, 0) + 1
    return counts
