"""Which adapters to keep pinned on which replicas: pure functions over the replicas' views.

Demand is each adapter's requests per round, summed over replicas (the deltas of
`loraserve_lora_requests_total`) and smoothed: `rate = s * this_round + (1 - s) * rate`. Adapters at
`min_rate` or more are hot. Each replica pins at most `budget` adapters (never more than `max_loras - 1`),
so the pins fit `P = sum of budgets` and about `P / copies` adapters get their `copies` replicas:

1. Keep: a replica keeps the pins it has for adapters still among the `2 * P / copies` hottest (a band
   twice what fits, so adapters near the edge do not flap in and out between rounds).
2. Fill: the hottest adapters, in order, get replicas until they have `copies`: first one that holds
   the adapter on the GPU (no load), then in the CPU tier (a copy only), then the one with the fewest
   pins (spread), then the order the replicas were given in.
3. Everything else pinned is unpinned: cold adapters, and those pushed out of the band.

Worked example: three replicas of 4 slots (3 pins each), `copies=2`, `budget=2` (P = 6, band: the 6
hottest), rates a=9, b=5, c=2, d=0.05, a on replica 0's GPU, c in replica 2's CPU tier, nothing pinned:

    a -> r0 (GPU), r1 (fewest pins, first)      b -> r2 (fewest), r0 (then first of r0, r1)
    c -> r2 (CPU tier), r1                      d -> below min_rate: pinned nowhere
    pins: r0 {a, b}, r1 {a, c}, r2 {b, c}

Which `copies` fits: where routing follows residency (llm-d's lora-load-state-scorer), 1 or 2 (the router
sends an adapter's requests where it is resident); where it does not (a plain Service, the stock
lora-affinity-scorer at low concurrency), the number of replicas (every replica sees every adapter).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraserve.placement.views import ReplicaView


class Demand:
    """Requests per adapter and round, from the replicas' cumulative counters, exponentially smoothed."""

    def __init__(self, smoothing: float = 0.5) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1] (got {smoothing})")
        self.smoothing = smoothing
        self.rates: dict[str, float] = {}
        self._last: dict[tuple[str, str], float] = {}  # (replica, adapter) -> counter at the last round

    def update(self, views: Iterable[ReplicaView]) -> dict[str, float]:
        """Fold in one round's counters. A counter seen for the first time, or lower than last time (the
        replica restarted), counts whole."""
        fresh: dict[str, float] = {}
        for view in views:
            for name, total in view.requests.items():
                last = self._last.get((view.url, name))
                delta = total if last is None or total < last else total - last
                fresh[name] = fresh.get(name, 0.0) + delta
                self._last[(view.url, name)] = total
        s = self.smoothing
        rates = {n: s * fresh.get(n, 0.0) + (1 - s) * self.rates.get(n, 0.0) for n in {*self.rates, *fresh}}
        self.rates = {n: r for n, r in rates.items() if r >= 1e-6}
        return dict(self.rates)


def plan(
    views: list[ReplicaView], rates: dict[str, float], copies: int, budget: int, min_rate: float
) -> dict[str, frozenset[str]]:
    """{replica url: adapter names to keep pinned there}, as described above."""
    if copies < 1 or budget < 0:
        raise ValueError(f"copies must be >= 1 and budget >= 0 (got {copies}, {budget})")
    capacity = {v.url: min(budget, v.max_pins) for v in views}
    pins: dict[str, set[str]] = {v.url: set() for v in views}
    order = {v.url: i for i, v in enumerate(views)}
    hot = sorted((n for n, r in rates.items() if r >= min_rate), key=lambda n: (-rates[n], n))
    rank = {name: i for i, name in enumerate(hot)}
    band = set(hot[: -(-2 * sum(capacity.values()) // copies)])
    for view in views:  # 1. keep
        for name in sorted(view.placed & band, key=rank.__getitem__)[: capacity[view.url]]:
            pins[view.url].add(name)
    for name in hot:  # 2. fill
        holders = sum(name in names for names in pins.values())
        free = [v for v in views if len(pins[v.url]) < capacity[v.url] and name not in pins[v.url]]
        if holders >= copies or not free:
            continue

        def preference(view: ReplicaView, name: str = name) -> tuple:
            tier = 0 if name in view.gpu else 1 if name in view.cpu else 2
            return (tier, len(pins[view.url]), order[view.url])

        for view in sorted(free, key=preference)[: copies - holders]:
            pins[view.url].add(name)
    return {url: frozenset(names) for url, names in pins.items()}


@dataclass(frozen=True)
class Action:
    url: str  # the replica's metrics listener
    op: str  # "pin" | "unpin"
    adapter_name: str


def actions(views: list[ReplicaView], desired: dict[str, frozenset[str]]) -> list[Action]:
    """The calls that turn what the operator pinned into `desired`: unpins first (they free budget)."""
    unpins = [Action(v.url, "unpin", n) for v in views for n in sorted(v.placed - desired.get(v.url, set()))]
    pins = [Action(v.url, "pin", n) for v in views for n in sorted(desired.get(v.url, set()) - v.placed)]
    return unpins + pins
