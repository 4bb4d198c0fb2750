"""Virtual token counters (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI'24).

Each tenant has a counter of the service it received, in weighted tokens divided by its weight:

    counter[t] += (prompt_weight * prompt tokens) / weight[t]    when a request is first admitted
    counter[t] += output_weight / weight[t]                      for every token it is scheduled to sample

Admission serves the backlogged tenant (one with waiting requests) whose counter is lowest. A tenant
that becomes backlogged again is lifted to the lowest counter of the backlogged tenants, or, when none
is backlogged, to the counter of the tenant that last left the backlog; it keeps its own counter if
that is higher. So an idle tenant saves no credit for later (it gets no burst when it comes back),
while a tenant that used more than its share keeps its debt.

Bound (the paper's theorem for this cost, generalised to weights): while tenants f and g are both
backlogged, over any interval

    | service_f / w_f  -  service_g / w_g |  <=  2 * U / min(w),
    U = max(prompt_weight * L_input, output_weight * M),

with L_input the longest prompt and M the most tokens the running batch can hold (the KV cache). It
assumes admission waits for the lowest tenant's request when that one lacks room; the scheduler passes
over such a request (or one kept out by `max_loras`) for at most `fairness_max_bypass_steps` steps
(work conservation), which can add that many steps of admissions to the gap. docs/OPERATIONS.md has
the worked numbers.
"""

from __future__ import annotations

# The key of requests that name no tenant: they share one counter.
DEFAULT_TENANT = "default"


def service_bound(
    prompt_weight: float, output_weight: float, max_prompt_tokens: int, max_batch_tokens: int
) -> float:
    """U of the bound above, in weighted tokens (divide by the smallest weight for counters)."""
    return max(prompt_weight * max_prompt_tokens, output_weight * max_batch_tokens)


class VirtualTokenCounters:
    """Counters, weights and backlog state per tenant; the scheduler tells it what happens."""

    def __init__(self, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0) -> None:
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self._counters: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._num_waiting: dict[str, int] = {}  # backlogged tenants only (> 0)
        self._last_left = 0.0  # counter of the tenant that last left the backlog

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def counters(self) -> dict[str, float]:
        return dict(self._counters)

    def add_waiting(self, tenant: str, weight: float) -> None:
        """A request of `tenant` (whose key carries `weight`) joins the waiting queue."""
        self._weights[tenant] = weight  # the latest request's key decides (keys of a tenant should agree)
        if tenant not in self._num_waiting:
            others = [self._counters.get(t, 0.0) for t in self._num_waiting]
            floor = min(others) if others else self._last_left
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)
            self._num_waiting[tenant] = 0
        self._num_waiting[tenant] += 1

    def remove_waiting(self, tenant: str) -> None:
        """A request of `tenant` leaves the waiting queue (admitted, finished or aborted)."""
        left = self._num_waiting[tenant] - 1
        if left:
            self._num_waiting[tenant] = left
        else:
            del self._num_waiting[tenant]
            self._last_left = self._counters.get(tenant, 0.0)

    def charge(self, tenant: str, num_prompt_tokens: int = 0, num_output_tokens: int = 0) -> float:
        """Add this service's cost over the tenant's weight to its counter; returns the cost itself."""
        cost = self.prompt_token_weight * num_prompt_tokens + self.output_token_weight * num_output_tokens
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / self.weight(tenant)
        return cost
