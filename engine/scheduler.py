"""Iteration-level scheduling: which requests compute how many tokens in the next step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine import fair_preemption
from engine.config import EngineConfig
from engine.fairness import VirtualTokenCounters
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.stats import TenantStats
from engine.tenant_queues import TenantQueues
from engine.tenant_usage import TenantLedger


class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of its all_token_ids.

    A plain slotted class, made once per request per step: a frozen dataclass costs several times more.
    """

    __slots__ = (
        "request",
        "num_new_tokens",
        "start",
        "block_ids",
        "num_tokens",
        "num_spec_tokens",
        "samples",
    )

    def __init__(
        self,
        request: Request,
        num_new_tokens: int,  # tokens computed this step, starting at `start`
        start: int,  # request.num_computed_tokens before this step (KV already in cache up to here)
        block_ids: list[int],  # [num_blocks_needed(start + num_new_tokens)] the whole block table
        # request.num_scheduled_tokens when scheduled (filled in if not given): `samples` must not
        # change when the engine appends this step's token to the request.
        num_tokens: int | None = None,
        # Speculative decoding: the last num_spec_tokens of the step's tokens are request.spec_token_ids,
        # proposals that follow the known tokens; the runner returns logits for each to verify them.
        num_spec_tokens: int = 0,
    ):
        self.request = request
        self.num_new_tokens = num_new_tokens
        self.start = start
        self.block_ids = block_ids
        self.num_tokens = request.num_scheduled_tokens if num_tokens is None else num_tokens
        self.num_spec_tokens = num_spec_tokens
        # True when this step computes the last known token, so the runner must sample one.
        self.samples = start + num_new_tokens - num_spec_tokens == self.num_tokens

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request.request_id!r}, num_new_tokens={self.num_new_tokens}, "
            f"start={self.start}, num_spec_tokens={self.num_spec_tokens}, samples={self.samples})"
        )


@dataclass
class SchedulerOutput:
    """What the runner computes in one step, and what changed in the scheduler's queues."""

    # Batch order: running (oldest first), then newly admitted. A request registers its blocks in the
    # prefix cache before those that come after it in the batch may hit them (KVCacheManager).
    scheduled: list[ScheduledRequest]
    preempted: list[Request]  # preempted this step; their blocks are already freed
    newly_admitted: list[Request]  # waiting or preempted requests that (re)entered running this step
    num_batched_tokens: int  # sum of num_new_tokens, at most max_num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching in the vLLM v1 style: every step re-decides the whole batch.

    Running requests go first, oldest first, so decodes never starve behind prefills. When blocks
    run out a running request is preempted (blocks freed, recomputed from token 0 later): under the
    "fair" policy the newest of the tenant with the highest virtual token counter (the one most over
    its share), under "fcfs" the newest overall.

    Waiting requests wait in one FIFO queue per tenant ("fair") or one queue for all ("fcfs").
    Admission takes the head of the queue whose tenant has the lowest counter (engine/fairness.py),
    again and again, while the token budget, `max_num_seqs`, free blocks and `max_loras` allow. A
    request whose adapter is still loading is skipped without holding up the requests behind it.
    Under "fcfs" so is one that would be one adapter too many, and a head that lacks room (blocks, or
    the budget without chunked prefill) stops admission. Under "fair" both are passed over, but only
    for `fairness_max_bypass_steps` steps each, after which admission waits for them, so that neither
    a stream of short prompts nor of other adapters can starve them. Also under "fair" (rules in
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
        self._requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.num_preemptions = 0  # cumulative, for metrics
        self.num_fairness_preemptions = 0  # the part of them that made room for a tenant below its share

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
        self._extend_capped(capped, budget, scheduled)
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
            num_new_tokens = request.num_scheduled_tokens - request.num_computed_tokens
            num_spec_tokens = len(request.spec_token_ids) if num_new_tokens == 1 else 0
            # Nothing to compute (the engine has not appended its sampled token yet), a request its
            # token in flight finishes anyway, or a split that chunked prefill forbids: not this step.
            if (
                num_new_tokens == 0
                or self._finishes_in_flight(request)
                or (num_new_tokens > budget and not self.config.enable_chunked_prefill)
            ):
                index += 1
                continue
            limit = budget
            if heads and request.num_tokens - request.num_computed_tokens > 1:  # a prefill, or a recompute
                limit = max(1, budget - fair_preemption.reserved_budget(request.tenant, heads, self.counters))
                if limit < min(num_new_tokens, budget):
                    capped.append(request)
            num_new_tokens = min(num_new_tokens + num_spec_tokens, limit)
            num_spec_tokens = max(0, num_new_tokens - 1) if num_spec_tokens else 0  # proposals the budget cut
            if num_spec_tokens and not self._proposals_fit(request, num_new_tokens, num_spec_tokens, index):
                num_new_tokens -= num_spec_tokens
                num_spec_tokens = 0
            del request.spec_token_ids[num_spec_tokens:]
            preempted_self = False
            while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                victim = self._pick_victim()
                position = self.running.index(victim)
                del self.running[position]
                if position < index:
                    index -= 1
                    item = next((s for s in scheduled if s.request is victim), None)
                    if item is not None:  # else it was passed over this step
                        scheduled.remove(item)
                        budget += item.num_new_tokens
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    preempted_self = True
                    break
            if preempted_self:
                continue  # the next request now sits at `index`
            scheduled.append(
                self._scheduled(request, num_new_tokens, request.num_computed_tokens, num_spec_tokens)
            )
            budget -= num_new_tokens
            index += 1
        return budget

    def _proposals_fit(self, request: Request, num_new_tokens: int, num_spec_tokens: int, index: int) -> bool:
        """Whether the blocks the proposals need beyond the request's own next token are free, keeping one
        for each running request after it: speculation never preempts anyone."""
        kv = self.kv_cache_manager
        total = request.num_computed_tokens + num_new_tokens
        have = len(kv.get_block_ids(request.request_id))
        if kv.num_blocks_needed(total) <= max(have, kv.num_blocks_needed(total - num_spec_tokens)):
            return True  # no block beyond what its known tokens need
        reserve = len(self.running) - index - 1
        return kv.num_blocks_needed(total) - have <= kv.block_pool.num_free_blocks - reserve

    def _pick_victim(self) -> Request:
        """The newest running request of the tenant with the highest counter ("fcfs": the newest)."""
        if not self.fair:
            return self.running[-1]
        victim, highest = None, 0.0
        for request in reversed(self.running):
            counter = self.counters.counter(request.tenant)
            if victim is None or counter > highest:
                victim, highest = request, counter
        return victim

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
                # Under fair, a request kept out by other adapters holds the line after a while, so that
                # their requests drain and free a slot for its adapter.
                if self.fair and not self._may_bypass(request):
                    break
                cursors[key] += 1
                continue
            if request.adapter_id is not None and not self.adapter_ready(request.adapter_id):
                cursors[key] += 1  # still loading: it waits without holding up anything
                continue
            hits, num_hit_tokens, num_new_tokens, fits = self._admission_plan(request, budget)
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
                    budget = self._preempt_for_fairness(victims, scheduled, preempted, budget)
                    for victim in victims:  # no victim comes back in the step that preempted it
                        cursors.pop(queues.key(victim), None)
                    adapters = {r.adapter_id for r in self.running if r.adapter_id is not None}
                    # Freeing the victims may have uncached blocks: find the prefix hits afresh (with
                    # the budget the victims were chosen for, so that the blocks they freed suffice).
                    hits, num_hit_tokens, num_new_tokens, fits = self._admission_plan(request, planned_budget)
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
            scheduled.append(self._scheduled(request, num_new_tokens, request.num_computed_tokens))
            budget -= num_new_tokens
        return budget

    def _admission_plan(self, request: Request, budget: int) -> tuple[list, int, int, bool]:
        """(prefix hits, their tokens, tokens to compute this step, whether that fits the budget)."""
        hits, num_hit_tokens = [], 0
        if request.num_computed_tokens == 0:
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit_tokens
        if num_new_tokens <= budget:
            return hits, num_hit_tokens, num_new_tokens, True
        # Without chunked prefill it waits for a step with room.
        return hits, num_hit_tokens, budget, self.config.enable_chunked_prefill

    def _preempt_for_fairness(
        self, victims: list[Request], scheduled: list[ScheduledRequest], preempted: list[Request], budget: int
    ) -> int:
        """Preempt `victims` during admission; those scheduled earlier in this step give back their
        tokens (nothing has run yet). Returns the budget."""
        for victim in victims:
            self.running.remove(victim)
            item = next((s for s in scheduled if s.request is victim), None)
            if item is not None:
                scheduled.remove(item)
                budget += item.num_new_tokens
            self._preempt(victim)
            preempted.append(victim)
            self.num_fairness_preemptions += 1
        return budget

    def _extend_capped(self, capped: list[Request], budget: int, scheduled: list[ScheduledRequest]) -> None:
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
            scheduled[index] = self._scheduled(request, num_new_tokens, item.start)

    def _finishes_in_flight(self, request: Request) -> bool:
        """Whether the token in flight ends the request by length (max_tokens or max_model_len): then
        computing one more would be wasted (a stop token cannot be foreseen; that step is wasted)."""
        if not request.num_in_flight:
            return False
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_in_flight
        if max_tokens is not None and num_outputs >= max_tokens:
            return True
        return request.num_scheduled_tokens >= self.max_model_len

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

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._queues.push(request, front=True)

    def _scheduled(
        self, request: Request, num_new_tokens: int, start: int, num_spec_tokens: int = 0
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new_tokens,
            start=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_spec_tokens=num_spec_tokens,
        )
