"""The shipped Grafana dashboard and Prometheus example read only metrics the server exports: every metric a
query names is one a `Metrics` registry renders (a renamed or dropped metric fails here, not on a dashboard)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from loraserve.ops.metrics import Metrics
from loraserve.routing import Variant

from engine.outputs import RequestTimes
from engine.stats import EngineStats, TenantStats

DEPLOY = Path(__file__).parents[2] / "deploy"
DASHBOARD = DEPLOY / "monitoring" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(?:vllm:|loraserve_)[A-Za-z0-9_:]*")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exported_families() -> set[str]:
    """Family names (as `# TYPE` declares them) of a registry that has seen one of everything."""
    tenant = TenantStats("acme", 1.0, 1, 3, 5, 0.1, 11.0, 1.0, 0, 0)
    stats = EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_preemptions=0,
        num_prompt_tokens=3,
        num_generation_tokens=5,
        running_adapters=("acme/a@1",),
        waiting_adapters=(),
        max_loras=4,
        num_lora_slots_in_use=1,
        num_adapters_loading=0,
        gpu_adapters=("acme/a@1",),
        tenants=(tenant,),
    )
    metrics = Metrics("tiny", lambda: stats, disk_adapters=lambda: [("acme", "a", 1)])
    metrics.observe_request(
        ttft=0.1,
        tpot=0.01,
        e2e=0.2,
        inter_token=[0.01],
        num_prompt_tokens=3,
        num_generation_tokens=5,
        times=[RequestTimes(queue=0.01, prefill=0.1, decode=0.2, inference=0.3)],
    )
    metrics.count_finished(["length"])
    for event in ("hit", "miss", "load", "evict"):
        metrics.adapter_event(event, "gpu", 0.01)
    metrics.route_picked("acme", "ab", Variant(adapter="a", weight=1), False)
    metrics.tenant_rate_limited("acme", "tokens")
    text = metrics.render().decode()
    return {family(line.split()[2]) for line in text.splitlines() if line.startswith("# TYPE ")}


def family(name: str) -> str:
    """The name without sample suffixes, stripped again for a histogram named `..._total` (vLLM's
    vllm:iteration_tokens_total: its buckets are `..._total_bucket`)."""
    stripped = True
    while stripped:
        stripped = False
        for suffix in SUFFIXES:
            if name.endswith(suffix):
                name, stripped = name[: -len(suffix)], True
    return name


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def test_residency_rules_name_exported_metrics():
    rules = yaml.safe_load((DEPLOY / "monitoring" / "adapter-residency-rules.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    exported = exported_families()
    assert len(exprs) == 2
    for expr in exprs:
        for name in METRIC.findall(expr):
            assert family(name) in exported, (name, expr)


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_families()
    queries = dashboard_queries()
    assert len(queries) > 15
    for query in queries:
        names = METRIC.findall(query)
        assert names, query
        for name in names:
            assert family(name) in exported, (name, query)


def test_every_exported_vllm_and_serving_metric_is_shown_somewhere():
    """The dashboard keeps up with the server: each family is on a panel (tenants' own per-field gauges and
    the info metric for the gateway are the deliberate exceptions)."""
    shown = {family(n) for q in dashboard_queries() for n in METRIC.findall(q)}
    not_on_dashboard = {
        "loraserve_lora_slots",  # capacity, for the residency rules
        "loraserve_adapter_resident",  # for the Inference Gateway's scorer (deploy/k8s/inference-gateway)
        "vllm:lora_requests_info",  # for the Inference Gateway's scorer
        "vllm:lora_adapter_loaded",  # per adapter: for llm-d's lora-load-state-scorer and `loraserve placement`
        "loraserve_tenant_requests",
        "loraserve_tenant_prompt_tokens",
        "loraserve_tenant_queue_time_seconds",
        "loraserve_tenant_virtual_tokens",
        "loraserve_tenant_weight",
        "loraserve_tenant_requests_running",
        "loraserve_tenant_requests_waiting",
    }
    missing = {f for f in exported_families() if f not in shown and f not in not_on_dashboard}
    assert not missing, missing


def test_prometheus_example_scrapes_the_metrics_port():
    config = yaml.safe_load((DEPLOY / "monitoring" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert all(t.endswith(":8001") for t in job["static_configs"][0]["targets"])
