"""Prometheus metrics on a registry of the app's own (two apps in one process never share counters).

Names follow vLLM where they overlap, so dashboards and the Gateway API Inference Extension's scorers
work unchanged; engine gauges and counters are read from the engine's published `EngineStats` at
scrape time rather than pushed on every step. `vllm:lora_requests_info` is, as in vLLM, a gauge whose
value is a timestamp and whose labels carry the comma-joined running and waiting adapters, named as
clients name them in `model` (see `affinity_names`).

With several front-end processes (`--api-server-count N`), each records its requests into
prometheus_client's multiprocess files (`multiprocess_dir`, set for every front end by the supervisor)
and renders the sum over all of them plus the engine's state, which every front end receives from the
one engine core: a scrape shows the replica, whichever process answers it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from adapter_format.names import split_adapter_id
from engine import EngineStats
from engine.outputs import RequestTimes
from engine.stats import HistogramCounts
from loraserve.ops.lora_residency_metrics import LoRAResidencyMetrics
from loraserve.routing import Variant

# vLLM's finished_reason values (its FINISH_REASON_STRINGS) that this engine produces.
FINISHED_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for vllm:request_params_n
_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets for its request phase histograms (queue, prefill, decode, inference)
_REQUEST_PHASE_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
# (metric, help, RequestTimes field): the engine request's phases, measured in the engine core
_REQUEST_PHASES = (
    ("vllm:request_queue_time_seconds", "Time from arrival to first scheduled (WAITING).", "queue"),
    ("vllm:request_prefill_time_seconds", "Time from first scheduled to first token (PREFILL).", "prefill"),
    ("vllm:request_decode_time_seconds", "Time from first token to last token (DECODE).", "decode"),
    (
        "vllm:request_inference_time_seconds",
        "Time from first scheduled to last token (RUNNING).",
        "inference",
    ),
)


class Metrics:
    """Histograms and counters the server observes, plus a collector over the engine and config store."""

    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats | None] = lambda: None,
        config_store_up: Callable[[], bool] = lambda: True,
        adapter_store_up: Callable[[], bool] = lambda: True,
        disk_adapters: Callable[[], Iterable[tuple[str, str, int]]] = lambda: (),
        multiprocess_dir: str | None = None,
    ) -> None:
        """`multiprocess_dir`: prometheus_client's PROMETHEUS_MULTIPROC_DIR, when this is one front-end
        process of several (the variable must be set before prometheus_client is first imported)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive token deliveries of a request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Tokens generated per request (all its completions).",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        # vLLM's: what each request asked for (n; max_tokens, or the room the context left it)
        self.request_params_n = Histogram(
            "vllm:request_params_n",
            "The n request parameter.",
            labels,
            buckets=_N_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_params_max_tokens = Histogram(
            "vllm:request_params_max_tokens",
            "The max_tokens request parameter.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_phases = [
            (
                field,
                Histogram(name, doc, labels, buckets=_REQUEST_PHASE_BUCKETS, registry=self.registry).labels(
                    model_name
                ),
            )
            for name, doc, field in _REQUEST_PHASES
        ]
        self.request_success = Counter(
            "vllm:request_success",
            "Completions that finished, by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISHED_REASONS:  # every series from the start, as vLLM does, so rate() alerts work
            self.request_success.labels(model_name, reason)
        self.cache_hits = Counter(
            "loraserve_adapter_cache_hits",
            "Adapter lookups served by a tier.",
            ["tier"],
            registry=self.registry,
        )
        self.cache_misses = Counter(
            "loraserve_adapter_cache_misses",
            "Adapter lookups a tier could not serve.",
            ["tier"],
            registry=self.registry,
        )
        self.load_seconds = Histogram(
            "loraserve_adapter_load_seconds",
            "Time to load an adapter into a tier.",
            ["tier"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self.evictions = Counter(
            "loraserve_adapter_evictions", "Adapters evicted from a tier.", ["tier"], registry=self.registry
        )
        self.route_requests = Counter(
            "loraserve_route_requests",
            "Requests per A/B route variant.",
            ["tenant", "route", "variant"],
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "loraserve_tenant_rate_limited",
            "Requests refused with 429 per tenant, by the limit hit (concurrency or tokens).",
            ["tenant", "limit"],
            registry=self.registry,
        )
        state = _StateCollector(model_name, engine_stats, config_store_up, adapter_store_up, disk_adapters)
        if multiprocess_dir is None:
            self._rendered = self.registry
        else:  # every front end's files summed, not this process's own values (which they include)
            self._rendered = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._rendered, path=multiprocess_dir)
        self._rendered.register(state)  # the engine's state: once, whichever process renders it
        # vLLM's residency series and requests per adapter (ops/lora_residency_metrics.py)
        self.lora_residency = LoRAResidencyMetrics(
            model_name, engine_stats, self.registry, state_registry=self._rendered
        )

    def observe_request(
        self,
        *,
        ttft: float,
        tpot: float | None,
        e2e: float,
        inter_token: Iterable[float] = (),
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
        times: Iterable[RequestTimes] = (),
        n: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        """One engine request (a prompt with its n completions) that produced tokens and ended; `times`:
        each completion's phases; `n` and `max_tokens` as it ran. Finish reasons are counted apart
        (count_finished), for every request."""
        self.request_params_n.observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)
        self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)
        for gap in inter_token:
            self.inter_token.observe(gap)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        for item in times:
            for field, histogram in self.request_phases:
                histogram.observe(getattr(item, field))

    def count_finished(self, finish_reasons: Iterable[str]) -> None:
        """Completions that ended, one reason each: stop, length, abort (client gone, cut stream, server
        stopping) or error (the engine failed it)."""
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason).inc()

    def adapter_event(self, event: str, tier: str, seconds: float = 0.0) -> None:
        """The engine's adapter observer (called from its threads; prometheus-client is thread-safe)."""
        if event == "hit":
            self.cache_hits.labels(tier).inc()
        elif event == "miss":
            self.cache_misses.labels(tier).inc()
        elif event == "load":
            self.load_seconds.labels(tier).observe(seconds)
            if tier == "source":  # into the CPU tier: vllm:lora_adapter_load_seconds
                self.lora_residency.observe_load(seconds)
        elif event == "evict":
            self.evictions.labels(tier).inc()

    def adapter_request(self, adapter_id: str) -> None:
        """A request resolved to this engine adapter (loraserve_lora_requests, for placement)."""
        self.lora_residency.count_request(adapter_id)

    def route_picked(self, tenant: str, route: str, variant: Variant, sticky: bool) -> None:
        """The Router's pick hook."""
        self.route_requests.labels(tenant, route, variant.label).inc()

    def tenant_rate_limited(self, tenant: str, limit: str) -> None:
        self.rate_limited.labels(tenant, limit).inc()

    def render(self) -> bytes:
        return generate_latest(self._rendered)


class _StateCollector(Collector):
    def __init__(
        self,
        model_name: str,
        engine_stats: Callable[[], EngineStats | None],
        config_store_up: Callable[[], bool],
        adapter_store_up: Callable[[], bool],
        disk_adapters: Callable[[], Iterable[tuple[str, str, int]]],
    ) -> None:
        self._model = model_name
        self._engine_stats = engine_stats
        self._config_store_up = config_store_up
        self._adapter_store_up = adapter_store_up
        self._disk_adapters = disk_adapters

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("loraserve_config_store_up", "1 while the config store answers, else 0.")
        up.add_metric([], 1.0 if self._config_store_up() else 0.0)
        yield up
        # /ready stays 200 through a store outage (every replica shares the store): this is where it shows.
        store_up = GaugeMetricFamily(
            "loraserve_adapter_store_up",
            "0 while the adapter store's last answer to this replica was a failure.",
        )
        store_up.add_metric([], 1.0 if self._adapter_store_up() else 0.0)
        yield store_up
        stats = self._engine_stats()
        yield self._residency(stats)
        if stats is None:
            return
        model = [self._model]
        yield _gauge("vllm:num_requests_running", "Requests running on the GPU.", stats.num_running, model)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to run.", stats.num_waiting, model)
        yield _gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage, 1 means 100 percent.", stats.kv_cache_usage, model
        )
        yield _counter("vllm:num_preemptions", "Preemptions since start.", stats.num_preemptions, model)
        yield _counter("vllm:prompt_tokens", "Prompt tokens processed.", stats.num_prompt_tokens, model)
        yield _counter("vllm:generation_tokens", "Tokens generated.", stats.num_generation_tokens, model)
        yield _counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.num_prefix_cache_queries,
            model,
        )
        yield _counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.num_prefix_cache_hits,
            model,
        )
        yield _histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine step.",
            stats.iteration_tokens,
            model,
        )
        if stats.cache_config:
            names = [name for name, _ in stats.cache_config]
            config = GaugeMetricFamily(
                "vllm:cache_config_info", "KV cache configuration (value 1).", labels=names
            )
            config.add_metric([value for _, value in stats.cache_config], 1.0)
            yield config
        slots = GaugeMetricFamily(
            "loraserve_lora_slots_in_use", "GPU adapter slots pinned by running requests."
        )
        slots.add_metric([], stats.num_lora_slots_in_use)
        yield slots
        yield _gauge(
            "loraserve_adapter_kv_cache_blocks",
            "Free KV blocks holding copies of adapters evicted from GPU slots (the KV tier; requests take "
            "them back at once).",
            stats.num_kv_adapter_blocks,
            model,
        )
        yield _gauge(
            "loraserve_adapter_kv_cache_adapters",
            "Adapters with a copy in free KV blocks (the KV tier), those back in a GPU slot included: they "
            "keep the copy until its blocks are taken.",
            stats.num_kv_adapters,
            model,
        )
        yield _counter(
            "loraserve_kernel_compiles_after_ready",
            "Triton kernels compiled after the engine was ready (stays 0: every variant is warmed up at start).",
            stats.num_kernel_compiles_after_ready,
            model,
        )
        replays = CounterMetricFamily(
            "loraserve_cuda_graph_replays",
            "Engine steps served by CUDA-graph replays (decode; speculative verification; piecewise: "
            "steps with prefill tokens).",
            labels=["model_name", "kind"],
        )
        replays.add_metric([self._model, "decode"], stats.num_decode_graph_replays)
        replays.add_metric([self._model, "verify"], stats.num_verify_graph_replays)
        replays.add_metric([self._model, "piecewise"], stats.num_piecewise_graph_replays)
        yield replays
        if stats.spec_decode is not None:
            yield from _spec_decode_families(stats, model)
        yield from _adapter_latency_families(stats, model)
        if stats.moe_expert_tokens:
            yield from _moe_families(stats, model)
        capacity = GaugeMetricFamily("loraserve_lora_slots", "GPU adapter slots (max_loras).")
        capacity.add_metric([], stats.max_loras)
        yield capacity
        # vLLM's labels, in vLLM's order; the value is the time of this snapshot (vLLM: set_to_current_time).
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting adapters (value: a timestamp).",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        info.add_metric(
            [
                str(stats.max_loras),
                affinity_names(stats.waiting_adapters),
                affinity_names(stats.running_adapters),
            ],
            time.time(),
        )
        yield info
        yield from _tenant_families(stats)

    def _residency(self, stats: EngineStats | None) -> Metric:
        """One series per adapter version and tier holding it, for an Inference Gateway scorer that prefers
        replicas with the adapter close (llm-d's proposal: GPU 1.0, CPU 0.7, a free slot 0.6)."""
        family = GaugeMetricFamily(
            "loraserve_adapter_resident",
            "1 for each adapter version a tier of this replica holds (gpu slot, cpu tier, disk cache); "
            "`adapter` is the name clients send.",
            labels=["tenant", "adapter", "version", "tier"],
        )
        tiers = (("gpu", stats.gpu_adapters), ("cpu", stats.cpu_adapters)) if stats is not None else ()
        for tier, adapter_ids in tiers:
            for adapter_id in adapter_ids:
                parts = split_adapter_id(adapter_id)
                tenant, name, version = parts if parts is not None else ("", adapter_id, 0)
                family.add_metric([tenant, name, str(version), tier], 1.0)
        for tenant, name, version in self._disk_adapters():
            family.add_metric([tenant, name, str(version), "disk"], 1.0)
        return family


# Per-tenant series from the engine's accounting (engine.stats.TenantStats). The labels name tenants, so
# these must stay where tenants cannot read them (like the rest of /metrics).
_TENANT_SERIES = (
    ("counter", "loraserve_tenant_requests", "Requests admitted per tenant.", "num_requests"),
    ("counter", "loraserve_tenant_prompt_tokens", "Prompt tokens admitted per tenant.", "num_prompt_tokens"),
    (
        "counter",
        "loraserve_tenant_generation_tokens",
        "Tokens generated per tenant.",
        "num_generation_tokens",
    ),
    (
        "counter",
        "loraserve_tenant_queue_time_seconds",
        "Seconds requests waited from arrival to first admission, summed per tenant.",
        "queue_time_s",
    ),
    (
        "gauge",
        "loraserve_tenant_service_share",
        "Part of the weighted tokens served in about the last minute, per tenant (0..1).",
        "share",
    ),
    (
        "gauge",
        "loraserve_tenant_virtual_tokens",
        "The fair scheduler's virtual token counter per tenant.",
        "virtual_tokens",
    ),
    ("gauge", "loraserve_tenant_weight", "The fair scheduler's weight per tenant.", "weight"),
    ("gauge", "loraserve_tenant_requests_running", "Running requests per tenant.", "num_running"),
    ("gauge", "loraserve_tenant_requests_waiting", "Waiting requests per tenant.", "num_waiting"),
)


def _spec_decode_families(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    """vLLM's speculative decoding counters (only when the engine speculates)."""
    spec = stats.spec_decode
    yield _counter(
        "vllm:spec_decode_num_drafts", "Verifications of a request's proposals.", spec.num_drafts, model
    )
    yield _counter(
        "vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens, model
    )
    yield _counter(
        "vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens, model
    )
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted, by position in the proposal (0: the first).",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        per_position.add_metric([*model, str(position)], count)
    yield per_position


def _moe_families(stats: EngineStats, model: list[str]) -> Iterator[Metric]:
    """A mixture of experts' routing, so imbalance shows: tokens per expert, and the worst layer's skew."""
    routed = CounterMetricFamily(
        "loraserve_moe_expert_tokens",
        "Tokens routed to each expert since start, summed over the MoE layers.",
        labels=["model_name", "expert"],
    )
    for expert, count in enumerate(stats.moe_expert_tokens):
        routed.add_metric([*model, str(expert)], count)
    yield routed
    yield _gauge(
        "loraserve_moe_load_imbalance",
        "The most imbalanced MoE layer's busiest expert's tokens over its mean since start (1: even).",
        stats.moe_load_imbalance,
        model,
    )


def _tenant_families(stats: EngineStats) -> Iterator[Metric]:
    for kind, name, doc, attribute in _TENANT_SERIES:
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = family_type(name, doc, labels=["tenant"])
        for tenant in stats.tenants:
            family.add_metric([tenant.tenant], getattr(tenant, attribute))
        yield family


def affinity_names(adapter_ids: Iterable[str]) -> str:
    """The comma-joined adapter names, as clients send them in `model`, of these engine adapters.

    The Gateway API Inference Extension's endpoint picker splits these labels on "," (no spaces, as
    vLLM joins them) and looks the request's `model` up in the result, so the labels must hold what
    clients send, not the engine's `tenant/name@version`. It also counts the entries against
    `max_lora` to find a free slot, so each adapter is listed once, under its bare name: `name@version`
    requests get no affinity, and two versions (or two tenants' adapters) of one name count once.
    Order follows `adapter_ids`, duplicates dropped; an id of another form passes unchanged.

        ("alpha/a@2", "beta/a@1", "beta/b@3")  ->  "a,b"
    """
    names: dict[str, None] = {}  # an ordered set
    for adapter_id in adapter_ids:
        parts = split_adapter_id(adapter_id)
        names[adapter_id if parts is None else parts[1]] = None
    return ",".join(names)


def _histogram(name: str, doc: str, counts: HistogramCounts, labels: list[str]) -> HistogramMetricFamily:
    """The engine's bucket counts (per bucket) as Prometheus' cumulative `le` buckets."""
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    _add_counts(family, labels, counts)
    return family


def _add_counts(family: HistogramMetricFamily, labels: list[str], counts: HistogramCounts) -> None:
    per_bucket = counts.counts or (0,) * (len(counts.bounds) + 1)
    cumulative = list(itertools.accumulate(per_bucket))
    bounds = [str(float(b)) for b in counts.bounds] + ["+Inf"]
    family.add_metric(labels, list(zip(bounds, cumulative)), counts.total)


# (metric, help, EngineStats field): per source tier (engine/lora/cold_starts.SOURCE_TIERS), no names
_ADAPTER_LATENCIES = (
    (
        "loraserve_adapter_ttft_seconds",
        "Engine-side time to first token of adapter requests, by the tier their adapter was in when they "
        "arrived (gpu: warm; kv, cpu, disk, store: a cold start).",
        "adapter_ttft",
    ),
    (
        "loraserve_adapter_cold_start_seconds",
        "Seconds from the first request that missed the GPU to the adapter usable there, by the tier it "
        "came from (kv, cpu, disk, store).",
        "adapter_cold_start",
    ),
)


def _adapter_latency_families(stats: EngineStats, model: list[str]) -> Iterable[Metric]:
    for name, doc, field in _ADAPTER_LATENCIES:
        family = HistogramMetricFamily(name, doc, labels=["model_name", "source_tier"])
        for tier, counts in getattr(stats, field):
            _add_counts(family, [*model, tier], counts)
        yield family


def _gauge(name: str, doc: str, value: Any, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: Any, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family
