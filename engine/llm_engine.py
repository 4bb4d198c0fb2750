"""The synchronous engine: requests in, one scheduled step at a time, outputs out.

Calls flow one way: engine -> scheduler -> KV cache manager; engine -> model runner -> model.
A bad request (too long, unknown or unloadable adapter) fails alone with an error that names the
problem; the engine keeps serving everything else.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import torch

from adapter_format.checkpoint import PeftAdapter
from adapter_format.errors import AdapterError
from adapter_format.events import Observer
from adapter_format.model_shape import ModelShape
from engine import kernel_compiles
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.fairness import DEFAULT_TENANT
from engine.kv_cache import KVCacheManager
from engine.logits_processors import apply_logits_processors, uses_processors
from engine.lora.manager import AdapterManager, AdapterSource
from engine.lora.registry import AdapterRegistry
from engine.model.loader import load_config, resolve_model_path
from engine.model_runner import ModelRunner
from engine.output_processor import ParentRequest, RequestState
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import NO_LORA, Request, RequestStatus
from engine.sampler import SampledStep, Sampler, on_device
from engine.sampling_params import WHOLE_VOCABULARY, SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.speculator import Speculator
from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats, Histogram, distinct_adapters
from engine.structured_output.matchers import StructuredOutputs
from engine.tokenizer import eos_token_ids, load_tokenizer
from engine.warmup import warm_up

logger = logging.getLogger(__name__)

Prompt = str | list[int]
# A step's sampling: queued on the device, plus its rows if they were already resolved one by one.
Sampled = tuple[SampledStep, list | None]
# Builds the adapter source once the model (and so its shape) is known: (shape, max_lora_rank) -> source.
AdapterSourceFactory = Callable[[ModelShape, int], AdapterSource]
# "cumulative": each output holds everything generated so far; "delta": only what is new since the last.
OUTPUT_KINDS = ("cumulative", "delta")


class RequestError(ValueError):
    """A request the engine refuses (the message names the problem)."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        skip_tokenizer_init: bool = False,
        adapter_source: AdapterSource | None = None,
        adapter_observer: Observer | None = None,
        adapter_source_factory: AdapterSourceFactory | None = None,
        detokenize: bool = True,
        output_kind: str = "cumulative",
    ):
        """`detokenize=False`: outputs carry token ids only (no text, no stop strings); the tokenizer is
        still loaded for structured outputs. The engine core process runs so: its front end makes text.

        `output_kind="delta"` (vLLM's RequestOutputKind.DELTA): each output carries only the tokens (and
        logprobs) new since the request's previous output, so a step costs the same at every length. The
        engine core runs so; it takes one completion per request (`n` is fanned out by its front end)."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)} (got {output_kind!r})")
        self.output_kind = output_kind
        self._delta_outputs = output_kind == "delta"
        if adapter_source is not None and adapter_source_factory is not None:
            raise ValueError("pass adapter_source or adapter_source_factory, not both")
        self.config = config
        self._detokenize = detokenize
        model_path = resolve_model_path(config.model)
        hf_config = load_config(model_path)
        self.max_model_len = _max_model_len(config, hf_config)
        self.tokenizer = (
            tokenizer if tokenizer is not None or skip_tokenizer_init else load_tokenizer(model_path)
        )
        self.eos_token_ids = eos_token_ids(model_path, hf_config, self.tokenizer)
        self._compiles = kernel_compiles.install()  # before the runner, so start-up compiles are counted
        self._compiles_at_ready = 0
        self.runner = ModelRunner(config, model_path, hf_config, self.max_model_len)
        capacity = self.runner.num_kv_blocks * config.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len {self.max_model_len}: "
                "lower max_model_len or give the cache more blocks"
            )
        self.kv_cache = KVCacheManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        # Local PEFT folders by name or path; a server plugs in the adapter store (usually through the
        # factory, since the model's shape is known only now).
        self.adapters = AdapterRegistry(self.runner.shape, config.max_lora_rank)
        if adapter_source_factory is not None:
            adapter_source = adapter_source_factory(self.runner.shape, config.max_lora_rank)
        self.lora = AdapterManager(
            adapter_source or self.adapters,
            self.runner.lora_slots,
            config.num_cpu_loras,
            observer=adapter_observer,
            in_processes=config.loads_in_processes,
        )
        self.scheduler = Scheduler(
            config, self.kv_cache, self.max_model_len, adapter_ready=self.lora.is_ready
        )
        self.sampler = Sampler(config.seed)
        spec = config.speculative_config
        self.speculator = Speculator(spec, self.max_model_len, self.runner) if spec is not None else None
        self._cache_config = (
            ("block_size", str(config.block_size)),
            ("cache_dtype", config.kv_cache_dtype),
            ("enable_prefix_caching", str(config.enable_prefix_caching)),
            ("num_gpu_blocks", str(self.runner.num_kv_blocks)),
        )
        vocab_size = self.runner.model.vocab_size
        self.structured = StructuredOutputs(self.tokenizer, vocab_size, self.eos_token_ids)
        self._in_flight: Sampled | None = None  # async scheduling: the launched step not yet read back
        if self.runner.device.type == "cuda":  # elsewhere nothing is compiled
            warm_up(self.runner, self.sampler)
        self._states: dict[str, RequestState] = {}  # child request id -> state
        self._parents: dict[str, list[str]] = {}  # user request id -> child ids
        self._pending: list[RequestOutput] = []  # refused or aborted requests, reported at the next step
        self._num_prompt_tokens = 0  # cumulative, for stats()
        self._num_generation_tokens = 0
        self._iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)  # tokens per step, for stats()
        self.mark_ready()

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        adapter: str | None = None,
        *,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
    ) -> None:
        """Queue a request. A request that cannot be served is reported as a failed output at the next
        step instead of raising, so one bad request never disturbs a batch.

        `tenant` is the fair scheduler's key (None: the one shared "default" key) and `tenant_weight`
        that tenant's weight: a tenant of weight 2 gets twice the share of weight 1 (engine/fairness.py)."""
        params = params or SamplingParams()
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant must be a non-empty string or None (got {tenant!r})")
        if isinstance(tenant_weight, bool) or not isinstance(tenant_weight, (int, float)):
            raise ValueError(f"tenant_weight must be a positive number (got {tenant_weight!r})")
        if not 0 < tenant_weight < float("inf"):
            raise ValueError(f"tenant_weight must be a positive number (got {tenant_weight!r})")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._delta_outputs and params.n > 1:
            raise ValueError("an engine with delta outputs takes n=1 requests: fan n out in front of it")
        prompt_text, prompt_ids = (prompt, None) if isinstance(prompt, str) else (None, list(prompt))
        try:
            prompt_ids = self._tokenize(prompt_text) if prompt_ids is None else prompt_ids
            adapter_id = self._resolve_adapter(adapter)
            self._check_prompt(prompt_ids)
            self._check_token_ids(params)
            params = self._capped_logprobs(params)
        except (AdapterError, RequestError) as exc:
            self._fail_unqueued(request_id, prompt_text, prompt_ids or [], adapter, str(exc))
            return
        parent = ParentRequest(request_id, prompt_text, prompt_ids, adapter, [None] * params.n)
        try:
            children = [
                self._new_child(parent, params, index, adapter_id, tenant, float(tenant_weight))
                for index in range(params.n)
            ]
        except ValueError as exc:  # the scheduler refuses what can never fit the KV cache
            self._fail_unqueued(request_id, prompt_text, prompt_ids, adapter, str(exc))
            return
        self._parents[request_id] = [child.request_id for child in children]
        if adapter_id is not None:
            self.lora.prefetch(adapter_id)

    def _new_child(
        self,
        parent: ParentRequest,
        params: SamplingParams,
        index: int,
        adapter_id: str | None,
        tenant: str,
        tenant_weight: float,
    ):
        child_id = parent.request_id if params.n == 1 else f"{parent.request_id}#{index}"
        child = Request(
            request_id=child_id,
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=child_params(params, index, self.eos_token_ids),
            adapter_id=adapter_id,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            tenant=tenant,
            tenant_weight=tenant_weight,
        )
        self.structured.add(child)  # an invalid spec raises here, before anything is queued
        try:
            self.scheduler.add_request(child)
        except ValueError:
            self.structured.free(child_id)
            raise
        if adapter_id is not None:
            self.lora.hold(adapter_id)
        detok = IncrementalDetokenizer(self.tokenizer, child) if self.tokenizer and self._detokenize else None
        self._states[child_id] = RequestState(child, parent, index, detok, delta=self._delta_outputs)
        return child

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            for child_id in self._parents.get(request_id, []):
                state = self._states.get(child_id)
                if state is None or state.request.is_finished:
                    continue
                self._finish(state.request, RequestStatus.FINISHED_ABORTED)
                self._pending.append(state.publish())
                self._forget(child_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self._in_flight is not None or self.scheduler.has_unfinished_requests()

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns what changed for each request.

        With `async_scheduling` the step's sampled tokens stay in flight: the host schedules and launches
        the next step (reading those tokens on the device) before it waits for them, so the GPU is not
        idle while the host does its bookkeeping; each call then returns the previous step's results.
        """
        self.poll_adapters()  # failed loads fail their waiting requests, in `_pending`
        outputs, self._pending = self._pending, []
        self.lora.stage(r.adapter_id for r in self.scheduler.waiting if r.adapter_id is not None)
        scheduled = self.scheduler.schedule()
        for request in scheduled.preempted:
            self._unpin(request)
        now = time.monotonic()
        for request in scheduled.newly_admitted:
            self._pin(request)
            if request.scheduled_time is None:
                request.scheduled_time = now
        launched = None
        if scheduled.scheduled:
            self._iteration_tokens.observe(scheduled.num_batched_tokens)
            if self.speculator is not None:
                self.speculator.before_execute(scheduled.scheduled)
            logits = self.runner.execute(scheduled.scheduled, self._in_flight_step())
            for request, entries in self.runner.prompt_logprobs.items():
                request.prompt_logprobs.extend(entries)
            self.lora.start_copies()  # while the GPU runs the step: issuing copies must not delay its launch
            sampling = self._sampling_rows(scheduled.scheduled)
            if sampling:
                if self._in_flight is not None and any(_needs_last_token(r) for r in sampling):
                    outputs.extend(self._update(self._in_flight))  # penalties, grammars read the tokens
                    self._in_flight = None
                # Grammar masks are filled on the host while the GPU still computes the logits; they go
                # last, so no bias can bring back a token the grammar forbids.
                prepared = self.structured.prepare(sampling)
                logits = self.structured.apply(apply_logits_processors(logits, sampling), prepared)
                launched = self._launch_sampling(logits, sampling)
        else:
            self.lora.start_copies()
            if self.lora.num_loading and self._in_flight is None:
                self.lora.wait_for_loads(timeout=0.05)  # nothing runnable until an adapter arrives
        if self.config.async_scheduling:
            finished, self._in_flight = self._in_flight, launched
            for request in launched[0].requests if launched else ():
                request.num_in_flight += 1
        else:
            finished = launched
        if finished is not None:
            outputs.extend(self._update(finished))
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return _merge_deltas(outputs) if self._delta_outputs else _latest_per_request(outputs)

    def _sampling_rows(self, scheduled) -> list[Request]:
        """The request of each logits row: one per sampling request, more with speculative proposals."""
        if self.speculator is not None:
            return self.speculator.sampling_rows(scheduled)
        return [s.request for s in scheduled if s.samples]

    def _in_flight_step(self) -> SampledStep | None:
        return self._in_flight[0] if self._in_flight is not None else None

    def _update(self, sampled: Sampled) -> list[RequestOutput]:
        """Append a step's sampled tokens to their requests: stop checks, finishes, outputs."""
        outputs = []
        rows = _rows(sampled)
        if self.speculator is not None:  # a request's proposals come as rows of their own: kept or not
            kept = self.speculator.verify(rows, self.sampler)
        else:
            kept = [(request, [token_id], [logprobs]) for request, token_id, logprobs in rows]
        for request, token_ids, token_logprobs in kept:
            request.num_in_flight = max(0, request.num_in_flight - 1)
            state = self._states.get(request.request_id)
            if state is None or state.request is not request or request.is_finished:
                continue  # finished (aborted, failed) while its token was in flight
            try:
                status = None
                for token_id, logprobs in zip(token_ids, token_logprobs):
                    if token_id is None:  # its own sampling raised: logprobs holds the reason
                        raise logprobs
                    request.append_output_token(token_id)
                    if request.first_token_time is None:
                        request.first_token_time = time.monotonic()
                    self._count_tokens(state)
                    status = state.append(token_id, logprobs, self.max_model_len)
                    if self.structured.accept(request, token_id) and status is None:
                        status = RequestStatus.FINISHED_STOPPED  # the structure is complete
                    if status is not None:
                        break  # tokens kept after a stop are dropped
            except Exception as exc:  # this request's data broke its own step: fail it, not the batch
                logger.exception("request %s failed in its step", request.request_id)
                request.error = f"the request failed while generating: {exc}"
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                self._finish(request, status)
            outputs.append(state.publish())
            if status is not None:
                self._forget(request.request_id)
        return outputs

    def _launch_sampling(self, logits, requests: list[Request]) -> Sampled:
        """The step's sampling, queued on the device. If sampling the batch raises, each row is sampled
        alone at once, so one request's data (a seed torch refuses, say) fails that request alone while
        the others keep their tokens; the rows then come back resolved, failed ones with the error."""
        try:
            return self.sampler.launch(logits, requests), None
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(requests))
        rows = []
        for i, request in enumerate(requests):
            try:
                one = self.sampler(logits[i : i + 1], [request])
                rows.append((request, one.token_ids[0], one.logprobs[0]))
            except Exception as exc:
                rows.append((request, None, exc))
        tokens = [0 if token_id is None else token_id for _, token_id, _ in rows]
        resolved = SampledStep(requests, on_device(tokens, logits.device), [], [torch.tensor(tokens)], None)
        return resolved, rows

    # -- adapters ---------------------------------------------------------------------------------

    def register_adapter(self, name: str, path: str) -> PeftAdapter:
        """Bind a name to a local PEFT folder (validated now). Registering a name again swaps it: new
        requests get the new weights; queued and running ones finish on the old, which is then dropped."""
        if self.lora.source is not self.adapters:
            raise RuntimeError(
                "register_adapter binds local folders, but this engine's adapters come from "
                f"{type(self.lora.source).__name__}; add the adapter there instead"
            )
        previous = self.adapters.current(name)
        adapter = self.adapters.register(name, path)
        if previous is not None:
            self.lora.retire(previous)
        return adapter

    def forget_adapter(self, adapter_id: str) -> None:
        """An adapter was deleted: new requests for it fail as unknown, queued ones that never started
        fail now (reported at the next step), running ones finish, and its slot frees after the last."""
        self.lora.forget(adapter_id)
        reason = f"adapter {adapter_id!r} was deleted before this request started"
        self._pending.extend(self._fail_waiting(adapter_id, reason, include_preempted=False))

    def preload_adapters(self, adapters: Iterable[str]) -> None:
        """Start loading adapters into the CPU tier before any request asks for them (a server's
        `--lora-modules`), so the first requests on a fresh replica do not wait for the disk or the store.
        Best effort and non-blocking: an adapter that cannot be resolved is logged and skipped, one that
        fails to load fails the requests that later ask for it, as it would without the preload."""
        for adapter in adapters:
            try:
                adapter_id = self._resolve_adapter(adapter)
            except (AdapterError, RequestError) as exc:
                logger.warning("adapter %r not preloaded: %s", adapter, exc)
                continue
            if adapter_id is not None:
                self.lora.prefetch(adapter_id)

    def poll_adapters(self) -> None:
        """Collect finished background loads; a failed one fails the requests waiting for it (reported at
        the next step). Each step does it first; an idle core too, so preloads reach the CPU tier."""
        for adapter_id, reason in self.lora.poll().items():
            self._pending.extend(self._fail_waiting(adapter_id, reason, include_preempted=True))

    def shutdown(self) -> None:
        """Stop the adapter loaders (threads and processes); the engine serves no adapter loads after it."""
        self.lora.shutdown()
        self.runner.shutdown()

    def mark_ready(self) -> None:
        """From now on every Triton compile is unexpected: counted in stats() and logged as a warning.
        The engine marks itself ready once built (after its warm-up); a server that warms up more may
        call this again."""
        self._compiles_at_ready = self._compiles.num_compiles
        self._compiles.warn = True

    def stats(self) -> EngineStats:
        """The engine's load right now (engine thread only; AsyncLLM publishes copies for others)."""
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            running_adapters=distinct_adapters(self.scheduler.running),
            waiting_adapters=distinct_adapters(self.scheduler.waiting),
            max_loras=self.config.max_loras,
            num_lora_slots_in_use=self.lora.num_slots_in_use,
            num_adapters_loading=self.lora.num_loading,
            tenants=self.scheduler.tenant_stats(),
            resident_adapters=self.lora.resident_ids(),
            num_prefix_cache_queries=self.kv_cache.num_queries_tokens,
            num_prefix_cache_hits=self.kv_cache.num_hit_tokens,
            cache_config=self._cache_config,
            gpu_adapters=self.lora.gpu_ids(),
            cpu_adapters=self.lora.cpu_ids(),
            num_kernel_compiles_after_ready=self._compiles.num_compiles - self._compiles_at_ready,
            iteration_tokens=self._iteration_tokens.snapshot(),
            spec_decode=self.speculator.stats() if self.speculator is not None else None,
        )

    def _resolve_adapter(self, adapter: str | None) -> str | None:
        if adapter is None:
            return None
        adapter_id = self.lora.resolve(adapter)
        reason = self.lora.error(adapter_id)
        if reason is not None:
            raise AdapterError("load_failed", reason)
        return adapter_id

    def _fail_waiting(self, adapter_id: str, reason: str, include_preempted: bool) -> list[RequestOutput]:
        """Fail the waiting requests of one adapter with `reason`, nothing else: those never admitted,
        and with `include_preempted` also those that ran before and wait to be recomputed."""
        outputs = []
        for request in [
            r
            for r in self.scheduler.waiting
            if r.adapter_id == adapter_id and (include_preempted or r.status is RequestStatus.WAITING)
        ]:
            request.error = reason
            self._finish(request, RequestStatus.FINISHED_ERROR)
            state = self._states[request.request_id]
            outputs.append(state.publish())
            self._forget(request.request_id)
        return outputs

    def _pin(self, request: Request) -> None:
        if request.adapter_id is not None:
            request.lora_slot = self.lora.acquire(request.adapter_id)

    def _unpin(self, request: Request) -> None:
        if request.adapter_id is None or request.lora_slot == NO_LORA:
            return
        self.lora.release(request.adapter_id)
        request.lora_slot = NO_LORA

    # -- helpers ----------------------------------------------------------------------------------

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self._unpin(request)
        self.scheduler.finish_request(request.request_id, status)
        request.status = status
        self.sampler.free(request.request_id)
        self.structured.free(request.request_id)
        if self.speculator is not None:
            self.speculator.free(request.request_id)

    def _count_tokens(self, state: RequestState) -> None:
        """vLLM's token counters: every sampled token; a prompt once per user request, at its first token."""
        self._num_generation_tokens += 1
        if state.index == 0 and state.request.num_output_tokens == 1:
            self._num_prompt_tokens += state.request.num_prompt_tokens

    def _forget(self, child_id: str) -> None:
        state = self._states.pop(child_id)
        if state.request.adapter_id is not None:
            self.lora.unhold(state.request.adapter_id)
        parent_id = state.parent.request_id
        if state.parent.finished:
            self._parents.pop(parent_id, None)

    def _fail_unqueued(self, request_id, prompt_text, prompt_ids, adapter, message: str) -> None:
        logger.warning("request %s refused: %s", request_id, message)
        completion = CompletionOutput(0, "", [], None, None, RequestStatus.FINISHED_ERROR.finish_reason, None)
        self._pending.append(
            RequestOutput(request_id, prompt_text, prompt_ids, [completion], True, adapter, message)
        )

    def _tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: pass prompts as token ids")
        ids = self.tokenizer(prompt).input_ids
        if not ids:
            raise RequestError("the prompt is empty")
        return ids

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token); shorten the prompt"
            )
        vocab = self.runner.model.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _capped_logprobs(self, params: SamplingParams) -> SamplingParams:
        """vLLM's rule: -1 asks for the whole vocabulary; more than `max_logprobs` (-1: the vocabulary) is
        refused with vLLM's message. Returns the params with -1 made the vocabulary size."""
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise RequestError(
                "prompt_logprobs is not supported with tensor parallelism (tensor_parallel_size > 1) yet; "
                "ask for them from a server on one GPU"
            )
        vocab = self.runner.model.vocab_size
        cap = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        changes = {}
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value == WHOLE_VOCABULARY:
                value = changes[name] = vocab
            if value is not None and value > cap:
                raise RequestError(
                    f"Requested {kind} logprobs of {value}, which is greater than max allowed: {cap}"
                )
        return dataclasses.replace(params, **changes) if changes else params

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids in logit_bias and allowed_token_ids must exist in this model's vocabulary."""
        vocab = self.runner.model.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def child_params(params: SamplingParams, index: int, eos_token_ids: list[int]) -> SamplingParams:
    """The params of child `index` of a request: each child of an n > 1 request samples independently
    (seed + index, as vLLM does), and only the first computes prompt logprobs; extra end-of-sequence ids
    of the checkpoint stop generation like eos itself. Applying it again to a child (index 0) changes
    nothing."""
    changes: dict = {"n": 1}
    if index > 0:  # the children share the prompt: the first one computes its logprobs
        changes["prompt_logprobs"] = None
    if params.seed is not None:
        changes["seed"] = params.seed + index
    extra_eos = [t for t in eos_token_ids[1:] if t not in params.stop_token_ids]
    if extra_eos and not params.ignore_eos:
        changes["stop_token_ids"] = [*params.stop_token_ids, *extra_eos]
    return dataclasses.replace(params, **changes)


def _max_model_len(config: EngineConfig, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: set max_model_len")
        return limit
    if limit is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return config.max_model_len


def _latest_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per user request per step (children of an n > 1 request each publish)."""
    latest: dict[str, RequestOutput] = {}
    for output in outputs:
        latest[output.request_id] = output
    return list(latest.values())


def _merge_deltas(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request per step, a request's deltas of the step joined in order."""
    merged: dict[str, RequestOutput] = {}
    for output in outputs:
        earlier = merged.get(output.request_id)
        if earlier is not None and earlier.outputs and output.outputs:
            before, now = earlier.outputs[0], output.outputs[0]
            now.token_ids = before.token_ids + now.token_ids
            if before.logprobs is not None and now.logprobs is not None:
                now.logprobs = before.logprobs + now.logprobs
        merged[output.request_id] = output
    return list(merged.values())


def _rows(sampled: Sampled) -> list[tuple[Request, int | None, object]]:
    """(request, token id, logprobs) per row; (request, None, error) for a row whose sampling raised."""
    step, rows = sampled
    if rows is not None:
        return rows
    result = step.result()
    return list(zip(step.requests, result.token_ids, result.logprobs))


def _needs_last_token(request: Request) -> bool:
    """Whether sampling the request's next token reads its previous one on the host (penalties, grammars):
    with async scheduling, a token still in flight is read back first."""
    params = request.sampling_params
    return bool(request.num_in_flight) and (params.structured_outputs is not None or uses_processors(params))
