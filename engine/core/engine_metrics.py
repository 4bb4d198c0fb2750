"""The engine's EngineStats: the counters only the step loop sees, and a snapshot of its load.

vLLM's token counters count every sampled token, and a prompt once per user request, at its first
token. Kernel compiles are counted from start-up; those after `mark_ready` are unexpected (a shape the
warm-up missed) and reported apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.lora.cold_starts import TierHistograms
from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats, Histogram, distinct_adapters

if TYPE_CHECKING:
    from engine.core.step_outputs import LiveRequest
    from engine.kv_cache import KVCacheManager
    from engine.lora.manager import AdapterManager
    from engine.scheduler import Scheduler
    from engine.spec_decode.speculator import Speculator


class EngineCounters:
    def __init__(self, compiles) -> None:
        self.num_prompt_tokens = 0  # cumulative
        self.num_generation_tokens = 0
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)  # tokens per step
        # Arrival in the engine -> first token, of requests with an adapter, by the tier it came from.
        self.adapter_ttft = TierHistograms()
        self._compiles = compiles  # engine.kernel_compiles' counter
        self._compiles_at_ready = 0

    def mark_ready(self) -> None:
        """From now on every Triton compile is unexpected: counted apart and logged as a warning."""
        self._compiles_at_ready = self._compiles.num_compiles
        self._compiles.warn = True

    @property
    def num_compiles_after_ready(self) -> int:
        return self._compiles.num_compiles - self._compiles_at_ready

    def count_token(self, live: LiveRequest) -> None:
        """One sampled token; its request's prompt too if this is the first token of the user request
        (`counts_prompt`: its first completion), and its TTFT if it has an adapter."""
        self.num_generation_tokens += 1
        request = live.request
        if request.num_output_tokens != 1:
            return
        if live.counts_prompt:
            self.num_prompt_tokens += request.num_prompt_tokens
        if request.adapter_id is not None and request.first_token_time is not None:
            cold = request.adapter_cold
            tier = "gpu" if cold is None else cold.tier
            self.adapter_ttft.observe(tier, request.first_token_time - request.arrival_time)


def cache_config(config: EngineConfig, num_kv_blocks: int) -> tuple[tuple[str, str], ...]:
    """vLLM's cache_config_info labels."""
    return (
        ("block_size", str(config.block_size)),
        ("cache_dtype", config.kv_cache_dtype),
        ("enable_prefix_caching", str(config.enable_prefix_caching)),
        ("gpu_memory_utilization", str(config.gpu_memory_utilization)),
        ("num_gpu_blocks", str(num_kv_blocks)),
        ("num_cpu_blocks", "0"),  # no KV blocks are swapped or offloaded to host memory
    )


def engine_stats(
    *,
    scheduler: Scheduler,
    kv_cache: KVCacheManager,
    lora: AdapterManager,
    speculator: Speculator | None,
    counters: EngineCounters,
    config: EngineConfig,
    cache_config: tuple[tuple[str, str], ...],
    graph_replays: tuple[int, int, int] = (0, 0, 0),
    routing=None,  # the model's RoutingCounts (a mixture of experts), else None
) -> EngineStats:
    """The engine's load right now, read from its scheduler, KV cache, adapter manager and counters."""
    return EngineStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        kv_cache_usage=kv_cache.usage,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens=counters.num_prompt_tokens,
        num_generation_tokens=counters.num_generation_tokens,
        running_adapters=distinct_adapters(scheduler.running),
        waiting_adapters=distinct_adapters(scheduler.waiting),
        max_loras=config.max_loras,
        num_lora_slots_in_use=lora.num_slots_in_use,
        num_adapters_loading=lora.num_loading,
        tenants=scheduler.tenant_stats(),
        resident_adapters=lora.resident_ids(),
        num_prefix_cache_queries=kv_cache.num_queries_tokens,
        num_prefix_cache_hits=kv_cache.num_hit_tokens,
        cache_config=cache_config,
        gpu_adapters=lora.gpu_ids(),
        cpu_adapters=lora.cpu_ids(),
        num_kv_adapters=lora.kv.num_adapters if lora.kv is not None else 0,
        num_kv_adapter_blocks=lora.kv.num_blocks if lora.kv is not None else 0,
        num_kernel_compiles_after_ready=counters.num_compiles_after_ready,
        iteration_tokens=counters.iteration_tokens.snapshot(),
        adapter_ttft=counters.adapter_ttft.snapshot(),
        adapter_cold_start=lora.cold_start_seconds.snapshot(),
        spec_decode=speculator.stats() if speculator is not None else None,
        num_decode_graph_replays=graph_replays[0],
        num_verify_graph_replays=graph_replays[1],
        num_piecewise_graph_replays=graph_replays[2],
        lora_residency=lora.residency(),
        **_routing(routing),
    )


def _routing(routing) -> dict:
    """EngineStats' MoE fields from the counts per layer and expert."""
    if routing is None or routing.counts.numel() == 0:
        return {}
    counts = routing.read()  # [layers, E]
    mean = counts.double().mean(dim=1)
    worst = (counts.amax(dim=1) / mean.clamp(min=1e-9)).where(mean > 0, torch.ones_like(mean))
    return dict(moe_expert_tokens=tuple(counts.sum(dim=0).tolist()), moe_load_imbalance=float(worst.max()))
