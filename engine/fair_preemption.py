"""Room for a tenant below its share: which running requests the fair scheduler preempts, and how
much of the token budget running prefills leave to lower-counter tenants' admissions.

Admission by virtual token counter (engine/fairness.py) decides who goes next, but cannot help a
tenant whose request finds the batch full: every `max_num_seqs` row, or the KV blocks, held by another
tenant's requests, each of which may run for hundreds of steps. So when the request admission picked
lacks a row or blocks, the scheduler preempts running requests of another tenant V for it (tenant T):

- V's counter is at least T's: V got at least as much service per weight;
- V holds far more of the batch than T, by weight, even after the move (rows: running requests):
  ROW_RATIO * (rows[T] + 1) / weight[T] <= (rows[V] - 1) / weight[V], with ROW_RATIO = 2, so that
  two tenants that both keep the batch busy do not trade rows over small differences;
- the victim ran before this step and was never preempted, for any reason;
- no request admitted in this step shares the blocks the victim registered for this step's tokens
  (their K/V would never be written; see KVCacheManager.shares_unwritten_blocks).

Among those the tenant with the highest counter (the most over its share) goes first, then its request
with the fewest computed tokens (the least work lost; recomputing hits the prefix cache), then its
newest. Victims are taken only if together they free the row and the blocks the request lacks.

No thrashing: a request is preempted for fairness at most once; each move lowers
sum(rows[t]^2 / weight[t]) strictly, so with no arrivals and finishes the moves stop; and a move T <- V
is never undone by V <- T, since after it rows[V] / weight[V] > rows[T] / weight[T]. Two tenants that
both flood keep within a factor of two of their weights' split of rows without preempting each other
(admission by counter does the rest as requests finish). A preempted request waits at the head of its
tenant's queue and is recomputed when admission reaches that tenant again; it is not charged again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.fairness import VirtualTokenCounters
    from engine.kv_cache import KVCacheManager
    from engine.request import Request

# How much more of the batch (rows per weight) a victim's tenant must keep than the taker's gets.
ROW_RATIO = 2


def pick_victims(
    request: Request,
    running: Sequence[Request],
    admitted_now: Sequence[Request],
    counters: VirtualTokenCounters,
    kv: KVCacheManager,
    *,
    need_row: bool,
    num_missing_blocks: int,
) -> list[Request]:
    """Running requests to preempt so that `request` gets a row (`need_row`) and `num_missing_blocks`
    more free blocks, by the rules above; [] when they cannot all be had (then nobody is preempted)."""
    tenant = request.meta.tenant
    floor = counters.counter(tenant)
    new_ids = {r.request_id for r in admitted_now}
    candidates = [
        r
        for r in running
        if r.meta.tenant != tenant
        and r.num_preemptions == 0
        and r.request_id not in new_ids
        and counters.counter(r.meta.tenant) >= floor
        and not kv.shares_unwritten_blocks(r)
    ]
    if not candidates:
        return []
    rows = Counter(r.meta.tenant for r in running)
    # T's rows per weight once admitted; a victim's tenant must keep ROW_RATIO times that after the move.
    taker = ROW_RATIO * (rows[tenant] + 1) / counters.weight(tenant)
    position_of = {id(r): position for position, r in enumerate(running)}
    candidates.sort(
        key=lambda r: (-counters.counter(r.meta.tenant), r.num_computed_tokens, -position_of[id(r)])
    )
    victims: list[Request] = []
    num_freed = 0
    while (need_row and not victims) or num_freed < num_missing_blocks:
        victim = next(
            (r for r in candidates if (rows[r.meta.tenant] - 1) / counters.weight(r.meta.tenant) >= taker),
            None,
        )
        if victim is None:
            return []
        candidates.remove(victim)
        victims.append(victim)
        rows[victim.meta.tenant] -= 1
        num_freed += kv.num_freeable_blocks(victim)
    return victims


def reserved_budget(tenant: str, heads: Sequence[Request], counters: VirtualTokenCounters) -> int:
    """Tokens of the step's budget a running prefill of `tenant` leaves to waiting requests first: what
    the heads of the other tenants' queues whose counters are not above its own still have to compute.
    Admission comes after the running requests, so without this a long prefill of a tenant over its
    share would take the budget from a newly arrived request of one below it. What admission leaves
    unused goes back to the prefill in the same step."""
    counter = counters.counter(tenant)
    return sum(
        head.num_tokens - head.num_computed_tokens
        for head in heads
        if head.meta.tenant != tenant and counters.counter(head.meta.tenant) <= counter
    )
