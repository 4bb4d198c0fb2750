"""What the placement loop knows of one replica: read from its metrics listener, as a router reads it.

`/metrics` (Prometheus text, parsed by prometheus_client): `vllm:lora_adapter_loaded{adapter_name, level,
pinned}`, `vllm:max_gpu_lora_adapters` and `loraserve_lora_requests_total{adapter_name}`; and
`GET /v1/residency` (the operator's endpoint): which adapters the operator pinned there, since the
`pinned` label also counts running requests' pins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

LOADED = "vllm:lora_adapter_loaded"
MAX_GPU = "vllm:max_gpu_lora_adapters"
REQUESTS = "loraserve_lora_requests_total"


@dataclass(frozen=True)
class ReplicaView:
    url: str  # the replica's metrics listener, e.g. http://10.0.0.7:8001
    max_gpu: int  # GPU adapter slots (max_loras)
    gpu: frozenset[str] = frozenset()  # adapter names holding a GPU slot
    cpu: frozenset[str] = frozenset()  # adapter names in the CPU tier only
    requests: dict[str, float] = field(default_factory=dict)  # adapter name -> requests since start
    placed: frozenset[str] = frozenset()  # adapter names the operator pinned here

    @property
    def max_pins(self) -> int:
        """Operator pins leave one slot to requests (ops/residency_controller.py)."""
        return max(0, self.max_gpu - 1)


def parse_view(url: str, metrics_text: str, residency: dict) -> ReplicaView:
    """A view from one scrape of /metrics and one GET /v1/residency answer."""
    gpu, cpu, requests, max_gpu = set(), set(), {}, None
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == LOADED and sample.value == 1:
                (gpu if sample.labels.get("level") == "gpu" else cpu).add(sample.labels["adapter_name"])
            elif sample.name == MAX_GPU:
                max_gpu = int(sample.value)
            elif sample.name == REQUESTS:
                requests[sample.labels["adapter_name"]] = sample.value
    if max_gpu is None:
        raise ValueError(
            f"{url}/metrics has no {MAX_GPU}: not a loraserve replica, or its engine is starting"
        )
    placed = frozenset(a["adapter_name"] for a in residency.get("adapters", ()) if a.get("placed"))
    return ReplicaView(url, max_gpu, frozenset(gpu), frozenset(cpu - gpu), requests, placed)
