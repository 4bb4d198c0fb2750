"""The engine core: requests of one sequence in, one scheduled step at a time, token deltas out.

Calls flow one way: engine core -> scheduler -> KV cache manager; engine core -> model runner -> model.
A bad request (too long, unknown or unloadable adapter) fails alone with an error that names the
problem; the core keeps serving everything else.

This file is the core's API and its step loop; the engine-core process (engine/core_process/) runs it
behind its sockets, and LLMEngine (engine/llm_engine.py) runs it in the caller's process. Either way it
takes `AddRequest`s (one sequence each, no stop strings) and each step returns `RequestDelta`s, read
straight from its request records; text, stop strings and the `n > 1` fan-in are the front end's
(engine/frontend/output_processor.py). Its parts (engine/core/): the checks a request passes on the way
in (request_checks.py), the unfinished requests and every way one ends (live_requests.py), sampling and
a step's deltas (step_outputs.py), and the counters behind `stats()` (engine_metrics.py).
"""

from __future__ import annotations

import gc
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
from engine.core import request_checks as checks
from engine.core.engine_metrics import EngineCounters, cache_config, engine_stats
from engine.core.live_requests import LiveRequests
from engine.core.request_checks import RequestError
from engine.core.step_outputs import Sampled, launch_sampling, needs_last_token, sampled_rows
from engine.kv_cache import KVCacheManager
from engine.kv_events import KVEventRecorder
from engine.kv_events.publisher import ZmqEventPublisher
from engine.logits_processors import apply_logits_processors
from engine.lora.manager import AdapterManager, AdapterSource
from engine.lora.registry import AdapterRegistry
from engine.messages import AddRequest, RequestDelta
from engine.model.loader import load_config, resolve_model_path
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.request_meta import RequestMeta
from engine.sampler import SampledStep, Sampler
from engine.scheduler import Scheduler
from engine.spec_decode.speculator import Speculator
from engine.stats import EngineStats
from engine.structured_output.matchers import StructuredOutputs
from engine.tokenizer import eos_token_ids, load_tokenizer
from engine.warmup import warm_up

logger = logging.getLogger(__name__)

# Builds the adapter source once the model (and so its shape) is known: (shape, max_lora_rank) -> source.
AdapterSourceFactory = Callable[[ModelShape, int], AdapterSource]
PRELOAD_LEVELS = ("cpu", "gpu")  # where preload_adapters brings adapters


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        skip_tokenizer_init: bool = False,
        adapter_source: AdapterSource | None = None,
        adapter_observer: Observer | None = None,
        adapter_source_factory: AdapterSourceFactory | None = None,
    ):
        """The tokenizer (loaded from the model unless given or `skip_tokenizer_init`) serves structured
        outputs here; the core never makes text."""
        if adapter_source is not None and adapter_source_factory is not None:
            raise ValueError("pass adapter_source or adapter_source_factory, not both")
        self.config = config
        model_path = resolve_model_path(config.model)
        hf_config = load_config(model_path)
        self.max_model_len = checks.serving_max_model_len(config, hf_config)
        self.tokenizer = (
            tokenizer if tokenizer is not None or skip_tokenizer_init else load_tokenizer(model_path)
        )
        self.eos_token_ids = eos_token_ids(model_path, hf_config, self.tokenizer)
        self._compiles = kernel_compiles.install()  # before the runner, so start-up compiles are counted
        self.counters = EngineCounters(self._compiles)
        self.runner = ModelRunner(config, model_path, hf_config, self.max_model_len)
        try:  # a start that fails here still frees the runner (and its workers) at once
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
            self.adapters = AdapterRegistry(
                self.runner.shape, config.max_lora_rank, vocab_modules_served=config.max_vocab_loras > 0
            )
            if adapter_source_factory is not None:
                adapter_source = adapter_source_factory(self.runner.shape, config.max_lora_rank)
            staging = self.runner.kv_tier_staging  # None: no KV tier (turned off, or tensor parallelism)
            self.lora = AdapterManager(
                adapter_source or self.adapters,
                self.runner.lora_slots,
                config.num_cpu_loras,
                observer=adapter_observer,
                in_processes=config.loads_in_processes,
                kv_cache=None
                if staging is None
                else (self.kv_cache.block_pool, self.runner.kv_storage, staging),
            )
            self.scheduler = Scheduler(
                config, self.kv_cache, self.max_model_len, adapter_ready=self.lora.is_ready
            )
            self.sampler = Sampler(config.seed)
            spec = config.speculative_config
            self.speculator = Speculator(spec, self.max_model_len, self.runner) if spec is not None else None
            self._cache_config = cache_config(config, self.runner.num_kv_blocks)
            vocab_size = self.runner.model.vocab_size
            self.structured = StructuredOutputs(
                self.tokenizer,
                vocab_size,
                self.eos_token_ids,
                compile_threads=config.grammar_compile_threads,
                compile_timeout_s=config.grammar_compile_timeout_s,
            )
            self._in_flight: Sampled | None = None  # async scheduling: the launched step not yet read back
            if self.runner.device.type == "cuda":  # elsewhere nothing is compiled
                warm_up(self.runner, self.sampler)
            self.requests = LiveRequests(
                self.scheduler,
                self.lora,
                self.structured,
                self.sampler,
                self.speculator,
                self.eos_token_ids,
                self.max_model_len,
                self.counters,
            )
            self.kv_events = self._open_kv_events(config)  # last: a failed start leaves no socket open
        except BaseException:
            if getattr(self, "lora", None) is not None:
                self.lora.shutdown()
            if getattr(self, "structured", None) is not None:
                self.structured.shutdown()
            self.runner.shutdown()
            raise
        self.closed = False
        self.mark_ready()

    # -- requests -------------------------------------------------------------------------------

    def add_core_request(self, request: AddRequest) -> None:
        """Queue one sequence (the front end's child of a user request: n == 1, no stop strings). A
        request whose data cannot be served is refused with a failed delta at the next step instead of
        raising, so one bad request never disturbs a batch; a priority this engine's policy would ignore
        raises RequestError, and an id already in use ValueError (the caller's mistake).

        `request.meta` (engine/request_meta.py, checked when built or decoded): the fair scheduler's
        tenant key and weight (a tenant of weight 2 gets twice the share of weight 1, engine/fairness.py),
        the priority (the priority policy's order), and vLLM's cache salt (the request reads and shares
        prefix-cache blocks only with requests of the same salt; engine/kv_cache/block_hash.py)."""
        self._check_open()
        self.check_meta(request.meta)
        request_id, params = request.request_id, request.params
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("the engine core takes one sequence per request: fan n out in front of it")
        try:
            adapter_id = checks.resolve_adapter(self.lora, request.adapter)
            vocab_size = self.runner.model.vocab_size
            checks.check_prompt(request.prompt_token_ids, self.max_model_len, vocab_size)
            checks.check_token_ids(params, vocab_size)
            params = checks.capped_logprobs(params, vocab_size, self.config)
        except (AdapterError, RequestError) as exc:
            code = exc.code if isinstance(exc, RequestError) else None
            self.requests.refuse(request_id, str(exc), code)
            return
        self.requests.queue(
            request_id,
            list(request.prompt_token_ids),
            params,
            adapter_id,
            request.meta,
            request.counts_prompt,
        )

    def check_meta(self, meta: RequestMeta) -> None:
        """What of `meta` depends on this engine: RequestError for a priority its policy would ignore."""
        checks.check_priority(
            meta.priority, self.scheduler.policy.uses_priority, self.config.scheduling_policy
        )

    def abort_core_requests(self, request_ids: Iterable[str]) -> None:
        """End these requests now (unknown or finished ids are ignored); each one's final delta, with
        finish_reason "abort", comes with the next step."""
        self.requests.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        if self.closed:
            return False
        return (
            bool(self.requests.pending)
            or self._in_flight is not None
            or self.scheduler.has_unfinished_requests()
        )

    # -- one step ---------------------------------------------------------------------------------

    def core_step(self) -> list[RequestDelta]:
        """Schedule and run one step; returns what each request gained (a request may have two deltas,
        in order, when a step reads back the previous one's tokens early).

        With `async_scheduling` the step's sampled tokens stay in flight: the host schedules and launches
        the next step (reading those tokens on the device) before it waits for them, so the GPU is not
        idle while the host does its bookkeeping; each call then returns the previous step's results.

        Under tensor parallelism a step a worker's death or hang cut short raises TensorParallelError
        (engine/parallel/workers.py) instead of returning deltas; the engine cannot step again.
        """
        self._check_open()
        with self.runner.step_guard():
            return self._step()

    def _step(self) -> list[RequestDelta]:
        self.poll_adapters()  # failed loads fail their waiting requests, in `requests.pending`
        self.requests.admit_compiled()  # compiled grammars free their requests; failed specs fail theirs
        deltas, self.requests.pending = self.requests.pending, []
        self.lora.stage(r.adapter_id for r in self.scheduler.waiting if r.adapter_id is not None)
        scheduled = self.scheduler.schedule()
        for request in scheduled.preempted:
            self.requests.unpin(request)
        now = time.monotonic()
        for request in scheduled.newly_admitted:
            self.requests.pin(request)
            if request.scheduled_time is None:
                request.scheduled_time = now
        launched = None
        if scheduled.scheduled:
            self.counters.iteration_tokens.observe(scheduled.num_batched_tokens)
            if self.speculator is not None:
                self.speculator.before_execute(scheduled.scheduled)
            logits = self.runner.execute(scheduled.scheduled, self._in_flight_step())
            for request, entries in self.runner.prompt_logprobs.items():
                request.prompt_logprobs.extend(entries)
            self.lora.start_copies()  # while the GPU runs the step: issuing copies must not delay its launch
            sampling = self._sampling_rows(scheduled.scheduled)
            if sampling:
                if self._in_flight is not None and any(needs_last_token(r) for r in sampling):
                    deltas.extend(self._update(self._in_flight))  # penalties, grammars read the tokens
                    self._in_flight = None
                # Grammar masks are filled on the host while the GPU still computes the logits; they go
                # last, so no bias can bring back a token the grammar forbids.
                prepared = self.structured.prepare(sampling)
                logits = self.structured.apply(apply_logits_processors(logits, sampling), prepared)
                launched = launch_sampling(self.sampler, logits, sampling)
        else:
            self.lora.start_copies()
            if self.lora.num_loading and self._in_flight is None:
                self.lora.wait_for_loads(timeout=0.05)  # nothing runnable until an adapter arrives
            if self.structured.num_compiling and self._in_flight is None:
                self.structured.wait(timeout_s=0.05)  # nor until a grammar compiles
        if self.config.async_scheduling:
            finished, self._in_flight = self._in_flight, launched
            for request in launched[0].requests if launched else ():
                request.num_in_flight += 1
        else:
            finished = launched
        if finished is not None:
            deltas.extend(self._update(finished))
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        self.publish_kv_events()
        return deltas

    def _sampling_rows(self, scheduled) -> list[Request]:
        """The request of each logits row: one per sampling request, more with speculative proposals."""
        if self.speculator is not None:
            return self.speculator.sampling_rows(scheduled)
        return [s.request for s in scheduled if s.samples]

    def _in_flight_step(self) -> SampledStep | None:
        return self._in_flight[0] if self._in_flight is not None else None

    def _update(self, sampled: Sampled) -> list[RequestDelta]:
        """Append a step's sampled tokens to their requests: stop checks, finishes, deltas."""
        rows = sampled_rows(sampled)
        if self.speculator is not None:  # a request's proposals come as rows of their own: kept or not
            kept = self.speculator.verify(rows, self.sampler)
        else:
            kept = [(request, [token_id], [logprobs]) for request, token_id, logprobs in rows]
        return self.requests.append(kept)

    # -- adapters ---------------------------------------------------------------------------------

    def register_adapter(self, name: str, path: str) -> PeftAdapter:
        """Bind a name to a local PEFT folder (validated now). Registering a name again swaps it: new
        requests get the new weights; queued and running ones finish on the old, which is then dropped."""
        if self.lora.source is not self.adapters:
            raise RuntimeError(
                "register_adapter binds local folders, but this engine's adapters come from "
                f"{type(self.lora.source).__name__}; add the adapter there instead"
            )
        self._check_open()
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
        self.requests.fail_waiting(adapter_id, reason, include_preempted=False)

    def preload_adapters(self, adapters: Iterable[str], level: str = "cpu", pin: bool = False) -> None:
        """Load adapters before any request asks for them: into the CPU tier (a server's `--lora-modules`),
        or with `level="gpu"` into a GPU slot, behind every waiting request's adapter, and with `pin` kept
        there until `unpin_adapters` (an operator's placement; engine/lora/placements.py).

        So the first requests on a replica do not wait for the disk or the store. Best effort and
        non-blocking: an adapter that cannot be resolved is logged and skipped, one that fails to load
        fails the requests that later ask for it, as it would without the preload. No lookup is counted
        (the hit and miss counters count requests)."""
        self._check_open()
        if level not in PRELOAD_LEVELS:
            raise ValueError(f"level must be one of {', '.join(PRELOAD_LEVELS)} (got {level!r})")
        if pin and level != "gpu":
            raise ValueError("only an adapter preloaded into a GPU slot (level='gpu') can be pinned")
        for adapter in adapters:
            try:
                adapter_id = checks.resolve_adapter(self.lora, adapter)
            except (AdapterError, RequestError) as exc:
                logger.warning("adapter %r not preloaded: %s", adapter, exc)
                continue
            if adapter_id is None:
                continue
            if level == "gpu":
                self.lora.place(adapter_id, pin)
            else:
                self.lora.load_to_cpu(adapter_id)

    def unpin_adapters(self, adapters: Iterable[str], unload: bool = False) -> None:
        """Undo `preload_adapters(..., pin=True)`: the adapters stay resident but evictable; with `unload`
        their GPU slots and CPU-tier rows are freed too, unless a request holds them. Unknown or unpinned
        adapters are ignored."""
        self._check_open()
        for adapter in adapters:
            try:
                adapter_id = self.lora.resolve(adapter)
            except AdapterError:
                continue
            self.lora.unplace(adapter_id, unload)

    def advance_adapters(self) -> None:
        """What an idle engine does each poll: collect finished loads, give placed adapters their GPU
        slots and copies (the steps do it otherwise), so preloads land with no request running; and
        publish the KV events of anything done between steps (aborts free blocks)."""
        self._check_open()
        self.poll_adapters()
        if not self.has_unfinished_requests():
            self.lora.stage(())
            self.lora.start_copies()
        self.publish_kv_events()

    # -- the prefix cache ---------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False, changing nothing, while any
        request holds blocks. Published as AllBlocksCleared when KV events are on."""
        self._check_open()
        reset = self.kv_cache.reset_prefix_cache()
        self.publish_kv_events()
        return reset

    def publish_kv_events(self) -> None:
        """Send the prefix cache's changes since the last call as one KV event batch (if any)."""
        if self.kv_events is not None:
            recorder, publisher = self.kv_events
            events = recorder.take()
            if events:
                publisher.publish(events)

    def _open_kv_events(self, config: EngineConfig) -> tuple[KVEventRecorder, ZmqEventPublisher] | None:
        settings = config.kv_events_config
        if settings is None or not settings.publishes:
            return None
        if not config.enable_prefix_caching:
            logger.warning("KV events need prefix caching, which is off: no block will ever be reported")
        recorder = KVEventRecorder(config.block_size, settings.event_encoding)
        self.kv_cache.record_events(recorder)
        return recorder, ZmqEventPublisher(settings)

    def poll_adapters(self) -> None:
        """Collect finished background loads; a failed one fails the requests waiting for it (reported at
        the next step). Each step does it first; an idle core too, so preloads reach the CPU tier."""
        for adapter_id, reason in self.lora.poll().items():
            self.requests.fail_waiting(adapter_id, reason, include_preempted=True)

    def shutdown(self) -> None:
        """Stop the adapter loaders (threads and processes) and the tensor-parallel workers, and free the
        model, the KV cache and the adapter tiers now, even while the caller keeps this object; a new
        engine may then start in this process. Idempotent; the engine serves nothing after it."""
        if getattr(self, "closed", True):
            return
        self.closed = True
        try:
            self.lora.shutdown()
            self.structured.shutdown()
        finally:
            self.runner.shutdown()
            if self.kv_events is not None:
                self.kv_events[1].close()
                self.kv_events = None
            # What still holds device or pinned memory: dropped so it frees now, not when this object goes.
            self._in_flight = None
            self.requests = self.scheduler = self.lora = self.speculator = self.kv_cache = None
            self.sampler = self.structured = None
            gc.collect()  # what the engine's parts still hold in reference cycles
            if self.config.torch_device.type == "cuda":
                torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine was shut down: start a new one")

    def mark_ready(self) -> None:
        """From now on every Triton compile is unexpected: counted in stats() and logged as a warning.
        The engine marks itself ready once built (after its warm-up); a server that warms up more may
        call this again."""
        self.counters.mark_ready()

    def stats(self) -> EngineStats:
        """The engine's load right now (engine thread only; AsyncLLM publishes copies for others)."""
        self._check_open()
        return engine_stats(
            scheduler=self.scheduler,
            kv_cache=self.kv_cache,
            lora=self.lora,
            speculator=self.speculator,
            counters=self.counters,
            config=self.config,
            cache_config=self._cache_config,
            graph_replays=self.runner.num_graph_replays,
            routing=getattr(self.runner.model, "routing", None),
        )
