"""Iteration-level scheduling: which requests compute how many tokens in the next step.

This file is the mechanism: running requests get their share of a step first, then waiting requests
are admitted while the budget, rows, blocks and adapter slots allow. What a scheduling policy decides
(the waiting queues' order, passing over or holding for a head, whom to preempt) is asked of the policy
object (engine/scheduling_policies/), never of its name. How many tokens each request computes (the
token budget, chunked prefill, speculative proposals) is engine/token_budget.py; preempting is
engine/preemption.py; the data handed to the model runner is engine/scheduler_output.py.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.fairness import VirtualTokenCounters
from engine.kv_cache import KVCacheManager
from engine.preemption import Preemptor
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.scheduling_policies import make_policy
from engine.stats import TenantStats
from engine.tenant_usage import TenantLedger
from engine.token_budget import TokenBudget
from engine.waiting_queues import WaitingQueues

# Where they were first defined: the model runner and the tests import them from here.
__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Continuous batching in the vLLM v1 style: every step re-decides the whole batch.

    Running requests go first, oldest first, so decodes never starve behind prefills. When blocks
    run out a running request is preempted (blocks freed, recomputed from token 0 later); the policy
    picks which.

    Waiting requests wait in FIFO queues keyed by the policy. Admission takes the head of the queue the
    policy ranks first, again and again, while the token budget, `max_num_seqs`, free blocks and
    `max_loras` allow. A request whose adapter is still loading (or whose grammar still compiles) is
    skipped without holding up the requests behind it. One that would be one adapter too many is
    skipped too, until the policy says it holds the line: then no other adapter takes a slot before it
    and the running adapter closest to done admits nothing new until its slot frees, while requests of
    the other running adapters (and of the base model) are still admitted. A head that lacks room
    (blocks, or the budget without chunked prefill) stops admission unless the policy lets admission
    pass over it. A head that finds the batch full (rows or blocks) may preempt the running requests
    the policy picks for it, and running prefills leave the token budget the policy reserves for the
    waiting heads. Tenants' virtual token counters (engine/fairness.py) are charged under every policy.
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
        self.counters = VirtualTokenCounters(
            config.fairness_prompt_token_weight, config.fairness_output_token_weight
        )
        self.policy = make_policy(config, self.counters)  # read-only for callers
        self.ledger = TenantLedger()
        # Read-only for callers. running: admission order, oldest first.
        self.running: list[Request] = []
        self._queues = WaitingQueues(self.policy, self.counters)  # the waiting requests
        # While a request holds the line for an adapter slot: the running adapter admitting nothing new.
        self._draining: str | None = None
        self._requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self._token_budget = TokenBudget(config, kv_cache_manager, max_model_len, self.policy)
        self._preemptor = Preemptor(kv_cache_manager, self._queues)

    @property
    def num_preemptions(self) -> int:
        """Cumulative, for metrics."""
        return self._preemptor.num_preemptions

    @property
    def num_admission_preemptions(self) -> int:
        """The part of the preemptions that made room for a waiting request (the policy's `pick_victims`)
        rather than for a running request's blocks."""
        return self._preemptor.num_admission_preemptions

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
            self.policy.forget(request)
        request.status = status
        self.kv_cache_manager.free(request)
        return request

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        capped: list[Request] = []  # running prefills that left budget to admissions
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
                generated[request.meta.tenant] = generated.get(request.meta.tenant, 0) + 1
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

        A victim scheduled earlier in this step (a policy may pick one) gives back its tokens: nothing of
        the step has run yet, so freeing its blocks loses no work. A prefill leaves the budget the policy
        reserves for the waiting heads (at least one token for itself), and if that capped it goes into
        `capped`, to get what admission leaves of it.
        """
        reserves = self.policy.reserves_budget and self.config.enable_chunked_prefill
        heads = self._queues.heads() if reserves else []
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
                victim = self.policy.pick_victim(self.running)
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
        """Admit heads of the queues the policy ranks first; skipped requests keep their place. Returns
        the budget left. A head that lacks a row or blocks may preempt the running requests the policy
        picks for it."""
        kv = self.kv_cache_manager
        adapters = {r.adapter_id for r in self.running if r.adapter_id is not None}
        queues = self._queues
        cursors = dict.fromkeys(queues.keys(), 0)  # per queue: its next candidate; earlier ones are skipped
        holding = False  # a request holds the line for an adapter slot (the policy said so)
        policy = self.policy
        while budget > 0 and (policy.preempts_for_admission or len(self.running) < self.config.max_num_seqs):
            key = min(
                (k for k, i in cursors.items() if i < len(queues.queue(k))), key=queues.rank, default=None
            )
            if key is None:
                break
            request = queues.queue(key)[cursors[key]]
            need_row = len(self.running) >= self.config.max_num_seqs  # only if the policy preempts for it
            if self._one_adapter_too_many(request.adapter_id, adapters):
                if need_row:  # not admitted this step anyway: no bypass to count
                    del cursors[key]
                    continue
                # A request kept out by other adapters may hold the line (the policy's call): no other
                # adapter takes a slot before it, and one running adapter drains (admits nothing new), so
                # a slot frees in bounded time while the other running adapters keep admitting.
                if policy.hold_for_slot(request):
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
            if request.grammar_pending:
                cursors[key] += 1  # its grammar still compiles: the same
                continue
            hits, num_hit_tokens, num_new_tokens, fits = self._token_budget.admission_plan(request, budget)
            num_missing_blocks = kv.num_missing_blocks(request, num_new_tokens, hits) if fits else 0
            if fits and (need_row or num_missing_blocks):
                victims = policy.pick_victims(
                    request,
                    self.running,
                    newly_admitted,
                    kv,
                    need_row=need_row,
                    num_missing_blocks=num_missing_blocks,
                )
                if victims:
                    planned_budget = budget
                    budget = self._preemptor.preempt_for_admission(
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
                del cursors[key]  # only a preemption admits anyone now; another queue may be owed one
                continue
            if not fits or kv.allocate_slots(request, num_new_tokens, hits) is None:
                if not policy.pass_over(request):
                    break  # admission waits for this head, so it cannot starve
                del cursors[key]  # the other queues go first this step
                continue
            if request.status is RequestStatus.WAITING:  # charged once, not again after a preemption
                request.num_cached_tokens = num_hit_tokens
                cost = self.counters.charge(request.meta.tenant, num_prompt_tokens=request.num_prompt_tokens)
                self.ledger.admitted(request, cost)
            queues.pop(key, cursors[key])
            policy.forget(request)
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
