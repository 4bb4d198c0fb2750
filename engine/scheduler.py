"""Iteration-level scheduling: which requests compute how many tokens in the next step.

This file is the queue policy: in which order running and waiting requests get their share of a step,
and which waiting requests are admitted. How many tokens each one computes (the token budget, chunked
prefill, speculative proposals) is engine/token_budget.py; who gives way when KV blocks run out is
engine/preemption.py; the data handed to the model runner is engine/scheduler_output.py.
"""

from __future__ import annotations

from collections.abc import Callable

from engine import fair_preemption
from engine.config import EngineConfig
from engine.fairness import VirtualTokenCounters
from engine.kv_cache import KVCacheManager
from engine.preemption import Preemptor
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.stats import TenantStats
from engine.tenant_queues import TenantQueues
from engine.tenant_usage import TenantLedger
from engine.token_budget import TokenBudget

# Where they were first defined: the model runner and the tests import them from here.
__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Continuous batching in the vLLM v1 style: every step re-decides the whole batch.

    Running requests go first, oldest first, so decodes never starve behind prefills. When blocks
    run out a running request is preempted (blocks freed, recomputed from token 0 later; the victim's
    rule is in engine/preemption.py).

    Waiting requests wait in one FIFO queue per tenant ("fair") or one queue for all ("fcfs").
    Admission takes the head of the queue whose tenant has the lowest counter (engine/fairness.py),
    again and again, while the token budget, `max_num_seqs`, free blocks and `max_loras` allow. A
    request whose adapter is still loading is skipped without holding up the requests behind it.
    Under "fcfs" so is one that would be one adapter too many, and a head that lacks room (blocks, or
    the budget without chunked prefill) stops admission. Under "fair" both are passed over, but only
    for `fairness_max_bypass_steps` steps each, so that neither a stream of short prompts nor of other
    adapters can starve them: after that, admission waits for a head that lacks room; for one that lacks
    an adapter slot, no other adapter takes a slot before it and the running adapter closest to done
    admits nothing new until its slot frees, while requests of the other running adapters (and of the
    base model) are still admitted. Also under "fair" (rules in
    engine/fair_preemption.py): a request that finds the batch full (rows or blocks) preempts running
    requests of a tenant more over its share, and running prefills leave the token budget first to
    waiting requests of tenants whose counters are not above theirs.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        adapter_ready: Callable[[str], bool] = lambda adapter_id: True,
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer (got {max_model_len!r})")
        # Without chunking a (re)admitted request needs all its tokens in one step; a longer one
        # would wait at the head of the queue forever.
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill off; raise it or enable chunked prefill"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.adapter_ready = adapter_ready
        self.fair = config.scheduling_policy == "fair"
        self.counters = VirtualTokenCounters(
            config.fairness_prompt_token_weight, config.fairness_output_token_weight
        )
        self.ledger = TenantLedger()
        # Read-only for callers. running: admission order, oldest first.
        self.running: list[Request] = []
        self._queues = TenantQueues(self.fair, self.counters)  # the waiting requests
        self._bypassed: dict[str, int] = {}  # request id -> steps admission went past it (fair only)
        # While a request holds the line for an adapter slot: the running adapter admitting nothing new.
        self._draining: str | None = None
        self._requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self._token_budget = TokenBudget(config, kv_cache_manager, max_model_len, self.counters)
        self._preemptor = Preemptor(self.fair, self.counters, kv_cache_manager, self._queues)

    @property
    def num_preemptions(self) -> int:
        """Cumulative, for metrics."""
        return self._preemptor.num_preemptions

    @property
    def num_fairness_preemptions(self) -> int:
        """The part of the preemptions that made room for a tenant below its share."""
        return self._preemptor.num_fairness_preemptions

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._queues)

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests (a new list) in about the order admission would take them."""
        return self._queues.in_admission_order()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or len(self._queues))

    def tenant_stats(self) -> tuple[TenantStats, ...]:
        return self.ledger.stats(self.counters.counters(), self.counters.weight, self.running, self._queues)

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError, naming the limit, if it could never run to completion."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: the prompt has {request.num_tokens} tokens, more than "
                f"max_model_len ({self.max_model_len}); shorten the prompt"
            )
        # A request must fit the whole cache alone at its longest, or it would preempt itself forever.
        max_tokens = request.sampling_params.max_tokens
        longest = self.max_model_len
        if max_tokens is not None:
            longest = min(longest, request.num_prompt_tokens + max_tokens)
        longest = max(longest, request.num_tokens)
        kv = self.kv_cache_manager
        if kv.num_blocks_needed(longest) > kv.num_blocks:
            raise ValueError(
                f"request {request.request_id}: {longest} tokens (prompt plus max_tokens, capped at "
                f"max_model_len) need {kv.num_blocks_needed(longest)} KV blocks but the cache has only "
                f"{kv.num_blocks} ({kv.num_blocks * kv.block_size} tokens); lower max_tokens or the prompt"
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._queues.push(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request at once, freeing its blocks; None for an unknown (or finished) id."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status (got {status})")
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self._queues.remove(request)
            self._bypassed.pop(request_id, None)
        request.status = status
        self.kv_cache_manager.free(request)
        return request

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        capped: list[Request] = []  # running prefills that left budget to admissions (fair only)
        budget = self._schedule_running(budget, scheduled, preempted, capped)
        newly_admitted: list[Request] = []
        # After a preemption the cache is full: admitting now would only preempt again.
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, newly_admitted, preempted)
        self._token_budget.extend_capped(capped, budget, scheduled)
        generated: dict[str, int] = {}  # tenant -> tokens this step samples for it
        for item in scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            request.status = RequestStatus.RUNNING
            if item.samples:  # one generated token, whatever the step recomputes
                generated[request.tenant] = generated.get(request.tenant, 0) + 1
        for tenant, num_tokens in generated.items():  # once per tenant: a step's decodes are its bulk
            cost = self.counters.charge(tenant, num_output_tokens=num_tokens)
            self.ledger.generated(tenant, num_tokens, cost)
        return SchedulerOutput(
            scheduled=scheduled,
            preempted=preempted,
            newly_admitted=newly_admitted,
            num_batched_tokens=sum(item.num_new_tokens for item in scheduled),
        )

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        preempted: list[Request],
        capped: list[Request],
    ) -> int:
        """Give each running request, oldest first, its next tokens; returns the budget left.

        A victim scheduled earlier in this step (only "fair" picks those) gives back its tokens: nothing
        of the step has run yet, so freeing its blocks loses no work. Under "fair" a prefill leaves the
        budget that waiting requests of tenants not above its own need (at least one token for itself),
        and goes into `capped`, to get what admission leaves of it.
        """
        heads = self._queues.heads() if self.fair and self.config.enable_chunked_prefill else []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            share = self._token_budget.running_share(request, budget, heads, len(self.running) - index - 1)
            if share is None:
                index += 1
                continue
            num_new_tokens, num_spec_tokens, capped_by_reserve = share
            if capped_by_reserve:
                capped.append(request)
            preempted_self = False
            while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                victim = self._preemptor.pick_victim(self.running)
                position = self.running.index(victim)
                del self.running[position]
                if position < index:
                    index -= 1
                    item = next((s for s in scheduled if s.request is victim), None)
                    if item is not None:  # else it was passed over this step
                        scheduled.remove(item)
                        budget += item.num_new_tokens
                self._preemptor.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    preempted_self = True
                    break
            if preempted_self:
                continue  # the next request now sits at `index`
            scheduled.append(
                self._token_budget.scheduled(
                    request, num_new_tokens, request.num_computed_tokens, num_spec_tokens
                )
            )
            budget -= num_new_tokens
            index += 1
        return budget

    def _schedule_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        newly_admitted: list[Request],
        preempted: list[Request],
    ) -> int:
        """Admit heads of the lowest-counter queues; skipped requests keep their place. Returns the
        budget left. Under "fair" a head that lacks a row or blocks may preempt others for them."""
        kv = self.kv_cache_manager
        adapters = {r.adapter_id for r in self.running if r.adapter_id is not None}
        queues = self._queues
        cursors = dict.fromkeys(queues.keys(), 0)  # per queue: its next candidate; earlier ones are skipped
        holding = False  # a request waits for an adapter slot past its bypasses (fair only)
        while budget > 0 and (self.fair or len(self.running) < self.config.max_num_seqs):
            key = min(
                (k for k, i in cursors.items() if i < len(queues.queue(k))), key=queues.priority, default=None
            )
            if key is None:
                break
            request = queues.queue(key)[cursors[key]]
            need_row = len(self.running) >= self.config.max_num_seqs  # only under fair here
            if self._one_adapter_too_many(request.adapter_id, adapters):
                if need_row:  # not admitted this step anyway: no bypass to count
                    del cursors[key]
                    continue
                # Under fair, a request kept out by other adapters holds the line after a while: no other
                # adapter takes a slot before it, and one running adapter drains (admits nothing new), so
                # a slot frees in bounded time while the other running adapters keep admitting.
                if self.fair and not self._may_bypass(request):
                    holding = True
                    if self._draining not in adapters:
                        self._draining = self._drain_victim()
                cursors[key] += 1
                continue
            if holding and request.adapter_id is not None:
                if request.adapter_id not in adapters or request.adapter_id == self._draining:
                    cursors[key] += 1  # its slot goes to the held request first
                    continue
            if request.adapter_id is not None and not self.adapter_ready(request.adapter_id):
                cursors[key] += 1  # still loading: it waits without holding up anything
                continue
            hits, num_hit_tokens, num_new_tokens, fits = self._token_budget.admission_plan(request, budget)
            num_missing_blocks = kv.num_missing_blocks(request, num_new_tokens, hits) if fits else 0
            if self.fair and fits and (need_row or num_missing_blocks):
                victims = fair_preemption.pick_victims(
                    request,
                    self.running,
                    newly_admitted,
                    self.counters,
                    kv,
                    need_row=need_row,
                    num_missing_blocks=num_missing_blocks,
                )
                if victims:
                    planned_budget = budget
                    budget = self._preemptor.preempt_for_fairness(
                        victims, self.running, scheduled, preempted, budget
                    )
                    for victim in victims:  # no victim comes back in the step that preempted it
                        cursors.pop(queues.key(victim), None)
                    adapters = {r.adapter_id for r in self.running if r.adapter_id is not None}
                    # Freeing the victims may have uncached blocks: find the prefix hits afresh (with
                    # the budget the victims were chosen for, so that the blocks they freed suffice).
                    hits, num_hit_tokens, num_new_tokens, fits = self._token_budget.admission_plan(
                        request, planned_budget
                    )
                    need_row = False
            if need_row:
                del cursors[key]  # only a preemption admits anyone now; another tenant may be owed one
                continue
            if not fits or kv.allocate_slots(request, num_new_tokens, hits) is None:
                if not self.fair or not self._may_bypass(request):
                    break  # admission waits for this head, so it cannot starve
                del cursors[key]  # the other queues go first this step
                continue
            if request.status is RequestStatus.WAITING:  # charged once, not again after a preemption
                request.num_cached_tokens = num_hit_tokens
                cost = self.counters.charge(request.tenant, num_prompt_tokens=request.num_prompt_tokens)
                self.ledger.admitted(request, cost)
            queues.pop(key, cursors[key])
            self._bypassed.pop(request.request_id, None)
            if not queues.has(key):
                cursors.pop(key, None)
            request.num_computed_tokens += num_hit_tokens
            self.running.append(request)
            newly_admitted.append(request)
            if request.adapter_id is not None:
                adapters.add(request.adapter_id)
            scheduled.append(
                self._token_budget.scheduled(request, num_new_tokens, request.num_computed_tokens)
            )
            budget -= num_new_tokens
        if not holding:
            self._draining = None
        return budget

    def _drain_victim(self) -> str | None:
        """The running adapter that frees a slot soonest if it admits nothing new: the fewest running
        requests, then the fewest tokens left to generate (the earliest in the batch on a tie)."""
        load: dict[str, tuple[int, int]] = {}
        for request in self.running:
            if request.adapter_id is not None:
                count, left = load.get(request.adapter_id, (0, 0))
                load[request.adapter_id] = (count + 1, left + _tokens_left(request, self.max_model_len))
        return min(load, key=load.__getitem__, default=None)

    def _may_bypass(self, request: Request) -> bool:
        """Whether admission may go past `request`, which lacks room or an adapter slot; counts the steps."""
        count = self._bypassed.get(request.request_id, 0)
        if count >= self.config.fairness_max_bypass_steps:
            return False
        self._bypassed[request.request_id] = count + 1
        return True

    def _one_adapter_too_many(self, adapter_id: str | None, adapters: set[str]) -> bool:
        return (
            adapter_id is not None and adapter_id not in adapters and len(adapters) >= self.config.max_loras
        )


def _tokens_left(request: Request, max_model_len: int) -> int:
    """Tokens the request may still generate: up to max_tokens, capped by the model's length."""
    max_tokens = request.sampling_params.max_tokens
    longest = (
        max_model_len if max_tokens is None else min(max_model_len, request.num_prompt_tokens + max_tokens)
    )
    return max(0, longest - request.num_tokens)
