"""Adapter residency under vLLM's coming names, for cluster routers and the placement loop.

vLLM's residency metrics (vLLM PRs #51433 -> #54830 -> #54833, open at the time of writing), read by
llm-d-router's `lora-load-state-scorer` (llm-d-router PR #2792, open):

- `vllm:lora_adapter_loaded{model_name, adapter_name, level, pinned, rank}`: 1 for each adapter on this
  replica, at the tier closest to the GPU: `level="gpu"` (it holds a GPU slot) or `"cpu"` (a CPU-tier row
  only); `pinned="true"` while it cannot be evicted (running requests or an operator's pin hold its slot);
  `rank` its largest LoRA rank. An evicted adapter's series disappears.
- `vllm:num_gpu_loaded_lora_adapters`, `vllm:num_cpu_loaded_lora_adapters`: adapter versions holding a
  GPU slot, and holding a CPU-tier row (GPU-resident ones included when they kept theirs).
- `vllm:max_gpu_lora_adapters`: the GPU slots (`--max-loras`).
- `vllm:lora_adapter_load_seconds`: the time of each load into the CPU tier (store or disk cache, read,
  validated, laid out), the load vLLM's histogram times; the copy into a GPU slot is
  `loraserve_adapter_load_seconds{tier="cpu"}`.

`adapter_name` is the tenant-qualified name routers route by: the engine id without its version,
`tenant/name` (engine.lora.router_names), which clients may send as `model` (`name` alone means the same
to the server, but a router matches strings). Several versions of one name at one level are one series:
pinned if any is, the largest rank. The counts count versions, since each takes a slot or a row.

`loraserve_lora_requests{adapter_name}` counts requests per adapter (the same names), so a placement loop
can tell hot adapters from cold ones across replicas. Every series here names tenants: like the rest of
/metrics they are served only to scrapers (the metrics listener, or the scrape key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import EngineStats
from engine.lora.router_names import router_name

# Adapter loads run from milliseconds (a disk-cache hit, small rank) to tens of seconds (a cold S3 read).
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class LoRAResidencyMetrics:
    """Registers the series above on `registry`; `observe_load` and `count_request` feed the two that
    are not read from the engine's stats."""

    def __init__(
        self, model_name: str, engine_stats: Callable[[], EngineStats | None], registry: CollectorRegistry
    ) -> None:
        self._model = model_name
        self.load_seconds = Histogram(
            "vllm:lora_adapter_load_seconds",
            "Time to load a LoRA adapter into the CPU tier (from the store or the disk cache).",
            ["model_name"],
            buckets=LOAD_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.requests = Counter(
            "loraserve_lora_requests",
            "Requests per adapter, by the tenant-qualified name routers route by.",
            ["adapter_name"],
            registry=registry,
        )
        registry.register(_ResidencyCollector(model_name, engine_stats))

    def observe_load(self, seconds: float) -> None:
        self.load_seconds.observe(seconds)

    def count_request(self, adapter_id: str) -> None:
        """One request (with its `n` completions) resolved to this engine adapter id."""
        self.requests.labels(router_name(adapter_id)).inc()


class _ResidencyCollector(Collector):
    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats | None]) -> None:
        self._model = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        if stats is None:
            return
        model = [self._model]
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "1 for each LoRA adapter loaded on this replica, at its closest level (gpu or cpu).",
            labels=["model_name", "adapter_name", "level", "pinned", "rank"],
        )
        for (name, level), (pinned, rank) in loaded_adapters(stats).items():
            loaded.add_metric([*model, name, level, "true" if pinned else "false", str(rank)], 1.0)
        yield loaded
        residency = stats.lora_residency
        for name, doc, value in (
            (
                "vllm:num_gpu_loaded_lora_adapters",
                "LoRA adapters holding a GPU slot.",
                sum(1 for r in residency if r.level == "gpu"),
            ),
            (
                "vllm:num_cpu_loaded_lora_adapters",
                "LoRA adapters holding a row of the CPU tier.",
                sum(1 for r in residency if r.in_cpu_tier),
            ),
            ("vllm:max_gpu_lora_adapters", "GPU slots for LoRA adapters (max_loras).", stats.max_loras),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(model, value)
            yield family


def loaded_adapters(stats: EngineStats) -> dict[tuple[str, str], tuple[bool, int]]:
    """{(adapter_name, level): (pinned, rank)}: the engine's residency records as vLLM's series.

    Versions of one name at one level merge: pinned if any is, the largest rank."""
    merged: dict[tuple[str, str], tuple[bool, int]] = {}
    for record in stats.lora_residency:
        key = (router_name(record.adapter_id), record.level)
        pinned, rank = merged.get(key, (False, 0))
        merged[key] = (pinned or record.pinned, max(rank, record.rank))
    return merged
