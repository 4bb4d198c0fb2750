"""A step's token budget: how many tokens each scheduled request computes, chunked prefill included.

A step computes at most `max_num_batched_tokens` tokens. With chunked prefill a long prompt (or a
preempted request's recompute) is split over several steps, each chunk taking what the budget leaves;
without it a request needs all its remaining tokens in one step and waits for a step with room. A
decoding request's speculative proposals ride along with its next token while the budget and the free
blocks allow: the budget cuts them first, and they never take a block that another running request
needs for its own next token. A running prefill leaves the budget the scheduling policy reserves for
the waiting queues' heads (under "fair", what tenants not above its own need: engine/fair_preemption.py),
and gets back what admission left unused at the end of the step (`extend_capped`).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.scheduler_output import ScheduledRequest
from engine.scheduling_policies import SchedulingPolicy


class TokenBudget:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        policy: SchedulingPolicy,
    ) -> None:
        self.chunked_prefill = config.enable_chunked_prefill
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = policy

    def running_share(
        self, request: Request, budget: int, heads: list[Request], num_running_after: int
    ) -> tuple[int, int, bool] | None:
        """A running request's tokens this step: (tokens to compute, how many of them are speculative
        proposals, whether the policy's reserve for `heads` capped it), or None when it computes nothing now.

        `heads`: the heads of the waiting queues as the step began (with chunked prefill only, else []);
        `num_running_after`: the running requests after this one, each of which keeps a block for its
        next token. Proposals the budget or the blocks cannot take are dropped from the request."""
        num_new_tokens = request.num_scheduled_tokens - request.num_computed_tokens
        num_spec_tokens = len(request.spec_token_ids) if num_new_tokens == 1 else 0
        # Nothing to compute (the engine has not appended its sampled token yet), a request its
        # token in flight finishes anyway, or a split that chunked prefill forbids: not this step.
        if (
            num_new_tokens == 0
            or self.finishes_in_flight(request)
            or (num_new_tokens > budget and not self.chunked_prefill)
        ):
            return None
        limit, capped = budget, False
        if heads and request.num_tokens - request.num_computed_tokens > 1:  # a prefill, or a recompute
            limit = max(1, budget - self.policy.reserved_budget(request, heads))
            capped = limit < min(num_new_tokens, budget)
        num_new_tokens = min(num_new_tokens + num_spec_tokens, limit)
        num_spec_tokens = max(0, num_new_tokens - 1) if num_spec_tokens else 0  # proposals the budget cut
        if num_spec_tokens and not self._proposals_fit(
            request, num_new_tokens, num_spec_tokens, num_running_after
        ):
            num_new_tokens -= num_spec_tokens
            num_spec_tokens = 0
        del request.spec_token_ids[num_spec_tokens:]
        return num_new_tokens, num_spec_tokens, capped

    def admission_plan(self, request: Request, budget: int) -> tuple[list, int, int, bool]:
        """(prefix hits, their tokens, tokens to compute this step, whether that fits the budget)."""
        hits, num_hit_tokens = [], 0
        if request.num_computed_tokens == 0:
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit_tokens
        if num_new_tokens <= budget:
            return hits, num_hit_tokens, num_new_tokens, True
        # Without chunked prefill it waits for a step with room.
        return hits, num_hit_tokens, budget, self.chunked_prefill

    def extend_capped(self, capped: list[Request], budget: int, scheduled: list[ScheduledRequest]) -> None:
        """Give the prefills that left budget to admissions what admission did not use, in place in the
        batch (blocks registered now come after every admission's hits were taken)."""
        for request in capped:
            if budget <= 0:
                return
            index = next((i for i, s in enumerate(scheduled) if s.request is request), None)
            if index is None:  # preempted since
                continue
            item = scheduled[index]
            num_new_tokens = min(request.num_scheduled_tokens - item.start, item.num_new_tokens + budget)
            if num_new_tokens == item.num_new_tokens:
                continue
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                continue  # the blocks went to admissions: the rest waits for the next step
            budget -= num_new_tokens - item.num_new_tokens
            scheduled[index] = self.scheduled(request, num_new_tokens, item.start)

    def finishes_in_flight(self, request: Request) -> bool:
        """Whether the token in flight ends the request by length (max_tokens or max_model_len): then
        computing one more would be wasted (a stop token cannot be foreseen; that step is wasted)."""
        if not request.num_in_flight:
            return False
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_in_flight
        if max_tokens is not None and num_outputs >= max_tokens:
            return True
        return request.num_scheduled_tokens >= self.max_model_len

    def scheduled(
        self, request: Request, num_new_tokens: int, start: int, num_spec_tokens: int = 0
    ) -> ScheduledRequest:
        """The request's share of the step, with its block table as it stands now."""
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new_tokens,
            start=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_spec_tokens=num_spec_tokens,
        )

    def _proposals_fit(
        self, request: Request, num_new_tokens: int, num_spec_tokens: int, num_running_after: int
    ) -> bool:
        """Whether the blocks the proposals need beyond the request's own next token are free, keeping one
        for each running request after it: speculation never preempts anyone."""
        kv = self.kv_cache_manager
        total = request.num_computed_tokens + num_new_tokens
        have = len(kv.get_block_ids(request.request_id))
        if kv.num_blocks_needed(total) <= max(have, kv.num_blocks_needed(total - num_spec_tokens)):
            return True  # no block beyond what its known tokens need
        return kv.num_blocks_needed(total) - have <= kv.block_pool.num_free_blocks - num_running_after
