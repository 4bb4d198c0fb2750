"""Iteration-level scheduling: which requests compute how many tokens in the next step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of its all_token_ids."""

    request: Request
    num_new_tokens: int  # tokens computed this step, starting at `start`
    start: int  # request.num_computed_tokens before this step (KV already in cache up to here)
    block_ids: list[int]  # [num_blocks_needed(start + num_new_tokens)] the whole block table
    # request.num_scheduled_tokens when scheduled (filled in if not given): `samples` must not change
    # when the engine appends this step's token to the request.
    num_tokens: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_tokens is None:
            object.__setattr__(self, "num_tokens", self.request.num_scheduled_tokens)

    @property
    def samples(self) -> bool:
        """True when this step computes the last known token, so the runner must sample one."""
        return self.start + self.num_new_tokens == self.num_tokens


@dataclass
class SchedulerOutput:
    """What the runner computes in one step, and what changed in the scheduler's queues."""

    scheduled: list[ScheduledRequest]  # batch order: running (oldest first), then newly admitted
    preempted: list[Request]  # preempted this step; their blocks are already freed
    newly_admitted: list[Request]  # waiting or preempted requests that (re)entered running this step
    num_batched_tokens: int  # sum of num_new_tokens, at most max_num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching in the vLLM v1 style: every step re-decides the whole batch.

    Running requests go first, oldest first, so decodes never starve behind prefills. When blocks
    run out the newest running request is preempted (blocks freed, recomputed from token 0 later).
    Waiting requests are admitted in FIFO order while the token budget, `max_num_seqs`, free blocks
    and `max_loras` allow; one whose adapter is not ready, or would be one adapter too many, is
    skipped without holding up the requests behind it.
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
        # Read-only for callers. running: admission order, oldest first; waiting: FIFO, preempted
        # requests at the front.
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # request_id -> every unfinished request
        self.num_preemptions = 0  # cumulative, for metrics

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

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
        self.waiting.append(request)

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
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        return request

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        newly_admitted: list[Request] = []
        # After a preemption the cache is full: admitting now would only preempt again.
        if not preempted:
            self._schedule_waiting(budget, scheduled, newly_admitted)
        for item in scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            item.request.status = RequestStatus.RUNNING
        return SchedulerOutput(
            scheduled=scheduled,
            preempted=preempted,
            newly_admitted=newly_admitted,
            num_batched_tokens=sum(item.num_new_tokens for item in scheduled),
        )

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> int:
        """Give each running request, oldest first, its next tokens; returns the budget left.

        Only requests after the current one are preempted, and those have nothing scheduled yet.
        """
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = request.num_scheduled_tokens - request.num_computed_tokens
            # Nothing to compute (the engine has not appended its sampled token yet), a request its
            # token in flight finishes anyway, or a split that chunked prefill forbids: not this step.
            if (
                num_new_tokens == 0
                or self._finishes_in_flight(request)
                or (num_new_tokens > budget and not self.config.enable_chunked_prefill)
            ):
                index += 1
                continue
            num_new_tokens = min(num_new_tokens, budget)
            while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return budget
            scheduled.append(self._scheduled(request, num_new_tokens, request.num_computed_tokens))
            budget -= num_new_tokens
            index += 1
        return budget

    def _schedule_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], newly_admitted: list[Request]
    ) -> None:
        """Admit waiting requests in FIFO order; skipped ones keep their place in the queue."""
        kv = self.kv_cache_manager
        adapters = {r.adapter_id for r in self.running if r.adapter_id is not None}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._adapter_admissible(request.adapter_id, adapters):
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if num_new_tokens > budget:
                if not self.config.enable_chunked_prefill:
                    break  # head-of-line waits for a step with room, so it cannot starve
                num_new_tokens = budget
            if kv.allocate_slots(request, num_new_tokens, hits) is None:
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens += num_hit_tokens
            self.running.append(request)
            newly_admitted.append(request)
            if request.adapter_id is not None:
                adapters.add(request.adapter_id)
            scheduled.append(self._scheduled(request, num_new_tokens, request.num_computed_tokens))
            budget -= num_new_tokens
        self.waiting.extendleft(reversed(skipped))

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

    def _adapter_admissible(self, adapter_id: str | None, adapters: set[str]) -> bool:
        if adapter_id is None:
            return True
        if adapter_id not in adapters and len(adapters) >= self.config.max_loras:
            return False
        return self.adapter_ready(adapter_id)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _scheduled(self, request: Request, num_new_tokens: int, start: int) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new_tokens,
            start=start,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
        )
