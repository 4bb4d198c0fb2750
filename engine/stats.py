"""A snapshot of the engine's load, for /metrics (vLLM's gauge and counter names map onto these fields)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from engine.request import Request
from engine.spec_decode.stats import SpecDecodeStats

# vLLM's buckets for vllm:iteration_tokens_total (tokens per engine step).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class HistogramCounts:
    """A histogram's state: observations per bucket (not cumulative), the last one above every bound."""

    bounds: tuple[float, ...] = ()  # upper bounds, ascending
    counts: tuple[int, ...] = ()  # len(bounds) + 1
    total: float = 0.0  # the sum of the observations


class Histogram:
    """Counts observations into fixed buckets; `snapshot()` is what EngineStats carries (immutable)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(self._bounds, tuple(self._counts), self._total)


@dataclass(frozen=True)
class EngineStats:
    """What the engine was doing at one moment; immutable, so any thread may read a published one.

    Counters (`num_preemptions`, `num_prompt_tokens`, `num_generation_tokens`) are cumulative since the
    engine started; the rest are gauges. Adapter ids are the engine's (e.g. "tenant/name@3").
    """

    num_running: int  # vllm:num_requests_running
    num_waiting: int  # vllm:num_requests_waiting (preempted requests included)
    kv_cache_usage: float  # vllm:kv_cache_usage_perc, 0..1
    num_preemptions: int  # vllm:num_preemptions_total
    num_prompt_tokens: int  # vllm:prompt_tokens_total, counted once per request at its first token
    num_generation_tokens: int  # vllm:generation_tokens_total
    running_adapters: tuple[str, ...]  # distinct, sorted; vllm:lora_requests_info running_lora_adapters
    waiting_adapters: tuple[str, ...]  # distinct, sorted; ... waiting_lora_adapters
    max_loras: int  # ... max_lora
    num_lora_slots_in_use: int  # GPU slots pinned by running requests
    num_adapters_loading: int  # background loads (store, disk) in flight
    # In a GPU slot or the CPU tier: a request for one of these needs no store call (the server's adapter
    # lookups serve them from their cache while the store is down).
    resident_adapters: frozenset[str] = frozenset()
    # The same by tier, sorted: holding a GPU slot, and in the pinned CPU tier (an adapter may be in both).
    gpu_adapters: tuple[str, ...] = ()
    cpu_adapters: tuple[str, ...] = ()
    # The KV tier (engine/lora/kv_tier.py): adapters with a copy in idle KV blocks (those back in a GPU
    # slot included: they keep it), and the blocks they hold (free blocks: kv_cache_usage does not count
    # them); 0 with the tier off.
    num_kv_adapters: int = 0
    num_kv_adapter_blocks: int = 0
    tenants: tuple[TenantStats, ...] = ()  # by tenant name; see TenantStats
    # Triton kernel variants compiled since the engine was marked ready (LLMEngine.mark_ready); should stay
    # 0: loraserve_kernel_compiles_after_ready_total.
    num_kernel_compiles_after_ready: int = 0
    # vllm:prefix_cache_queries / hits: prompt tokens looked up in the prefix cache at admission, and found
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # vllm:cache_config_info's labels, as (name, value) pairs (fixed once the engine is built)
    cache_config: tuple[tuple[str, str], ...] = ()
    # vllm:iteration_tokens_total: tokens computed per step, since the engine started
    iteration_tokens: HistogramCounts = HistogramCounts()
    # vllm:spec_decode_* counters; None when the engine does not speculate
    spec_decode: SpecDecodeStats | None = None
    # Steps served by CUDA-graph replays since start-up: decode steps, and speculative verification
    # steps, and steps with prefill tokens through piecewise graphs
    # (loraserve_cuda_graph_replays_total{kind="decode"|"verify"|"piecewise"}); the rest ran eagerly.
    num_decode_graph_replays: int = 0
    num_verify_graph_replays: int = 0
    num_piecewise_graph_replays: int = 0
    # (source tier, histogram) of adapter requests' engine-side TTFT, and of adapter cold starts (first
    # GPU miss -> usable on the GPU); tiers in engine/lora/cold_starts.SOURCE_TIERS, observed ones only.
    adapter_ttft: tuple[tuple[str, HistogramCounts], ...] = ()
    adapter_cold_start: tuple[tuple[str, HistogramCounts], ...] = ()
    # Every adapter in a GPU slot or the CPU tier, by id (vllm:lora_adapter_loaded and its counts)
    lora_residency: tuple[AdapterResidency, ...] = ()
    # A mixture of experts' routing since the start (empty for a dense model): tokens routed to each
    # expert, summed over the MoE layers; and the worst layer's imbalance, its busiest expert's tokens over
    # its mean (1.0: even). loraserve_moe_expert_tokens_total, loraserve_moe_load_imbalance.
    moe_expert_tokens: tuple[int, ...] = ()
    moe_load_imbalance: float = 0.0


@dataclass(frozen=True)
class AdapterResidency:
    """Where one adapter version sits on this engine: the tier closest to the GPU, and what keeps it there.

    `level` is "gpu" (it holds a GPU slot, its copy done or in flight) or "cpu" (a row of the CPU tier
    only). `pinned`: not evictable now (running requests or an operator's pin hold its slot);
    `placed`: an operator's pin (LLMEngine.preload_adapters with pin=True) is among those holds.
    `in_cpu_tier`: a GPU-resident adapter may also keep its CPU-tier row.
    """

    adapter_id: str
    level: str  # "gpu" | "cpu"
    pinned: bool
    rank: int  # its largest rank (0 while unknown)
    placed: bool = False
    in_cpu_tier: bool = False


def distinct_adapters(requests: Iterable[Request]) -> tuple[str, ...]:
    """The adapters some of `requests` use, sorted (base-model requests name none)."""
    return tuple(sorted({r.adapter_id for r in requests if r.adapter_id is not None}))


@dataclass(frozen=True)
class TenantStats:
    """One tenant's use of this engine since it started (counters) and right now (gauges).

    Tokens are the scheduler's cost view: a request's prompt counts once, when it is first admitted
    (each of the `n` completions of a request is a request of its own); generated tokens count when
    they are scheduled. `share` is the tenant's part of all weighted service of about the last minute.
    """

    tenant: str
    weight: float
    num_requests: int  # admitted at least once
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time_s: float  # summed over requests: arrival to first admission
    virtual_tokens: float  # the fairness counter (weighted tokens / weight, lifts included)
    share: float  # 0..1
    num_running: int
    num_waiting: int
