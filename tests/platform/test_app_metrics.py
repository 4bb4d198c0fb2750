"""/metrics speaks vLLM's names where they overlap, counts route variants and adapter cache events, and
is served to scrapers only (the metrics port, or a scrape key); /health and /ready answer for probes."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import replace

import pytest
from app_fixtures import make_text_model
from factories import make_adapter
from loraserve.ops.metrics import Metrics, affinity_names
from loraserve.ops.readiness import ADAPTER_STORE_DOWN, Readiness
from loraserve.routing import Route, Variant
from loraserve.settings import METRICS_OFF, ServerSettings
from prometheus_client.parser import text_string_to_metric_families
from test_inference_completions import run

from engine import EngineStats
from engine.stats import HistogramCounts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("metrics") / "model")


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return make_adapter(
        model_dir,
        tmp_path_factory.mktemp("metrics-adapter") / "a",
        seed=9,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
    )


# ServerSettings() listens on 8000, so its metrics listener is 8001; httpx's ASGI transport hands the
# URL's port to the app as the listening socket's (scope["server"]).
METRICS_URL = "http://testserver:8001/metrics"


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels): value}"""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict, name: str, **labels) -> float:
    return found[(name, frozenset(labels.items()))]


@pytest.mark.slow
def test_metrics_after_adapter_and_route_requests(tmp_path, model_dir, adapter_dir):
    async def scenario(client, services):
        before = (await client.get(METRICS_URL)).text
        services.adapter_store.put("default", "a", adapter_dir)
        await services.config_store.put_route(
            "default", Route(name="ab", variants=(Variant(adapter="a", weight=1),))
        )
        body = {"prompt": [4, 5, 6], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        routed = await client.post("/v1/completions", json={**body, "model": "ab", "user": "u1"})
        for _ in range(2):
            await client.post("/v1/completions", json={**body, "model": "a"})
        await client.post("/v1/completions", json={**body, "model": "tiny"})
        for _ in range(200):  # the engine publishes its stats snapshot just after the last step's outputs
            if services.engine.stats().num_generation_tokens == 20:
                break
            await asyncio.sleep(0.005)
        return (
            before,
            routed,
            await client.get(METRICS_URL),
            await client.get("/ready"),
            await client.get("/health"),
        )

    before, routed, metrics, ready, health = run(tmp_path, model_dir, scenario)
    assert routed.status_code == 200 and routed.headers["x-loraserve-variant"] == "a@1"
    assert metrics.headers["content-type"].startswith("text/plain")
    found = samples(metrics.text)
    model = {"model_name": "tiny"}
    assert value(found, "vllm:time_to_first_token_seconds_count", **model) == 4
    assert value(found, "vllm:e2e_request_latency_seconds_count", **model) == 4
    assert value(found, "vllm:time_per_output_token_seconds_count", **model) == 4
    # vLLM's per-request series: 4 requests of 5 tokens, 3-token prompts, every one ending at its length
    assert value(found, "vllm:request_success_total", finished_reason="length", **model) == 4
    assert value(found, "vllm:request_prompt_tokens_sum", **model) == 12
    assert value(found, "vllm:request_generation_tokens_sum", **model) == 20
    assert value(found, "vllm:request_generation_tokens_count", **model) == 4
    assert value(found, "vllm:request_params_n_count", **model) == 4
    assert value(found, "vllm:request_params_n_sum", **model) == 4
    assert value(found, "vllm:request_params_max_tokens_sum", **model) == 20
    inter_token = value(found, "vllm:inter_token_latency_seconds_count", **model)
    assert 4 <= inter_token <= 16  # at most 4 gaps per request of 5 tokens (deltas may carry several)
    assert value(found, "vllm:generation_tokens_total", **model) == 20
    assert value(found, "vllm:prompt_tokens_total", **model) == 12
    assert value(found, "vllm:num_requests_running", **model) == 0
    assert value(found, "vllm:num_requests_waiting", **model) == 0
    assert 0 <= value(found, "vllm:kv_cache_usage_perc", **model) <= 1
    assert ("vllm:num_preemptions_total", frozenset(model.items())) in found
    assert value(found, "loraserve_route_requests_total", tenant="default", route="ab", variant="a") == 1
    assert value(found, "loraserve_config_store_up") == 1
    assert value(found, "loraserve_adapter_store_up") == 1
    assert value(found, "loraserve_lora_slots_in_use") == 0
    assert value(found, "loraserve_kernel_compiles_after_ready_total", **model) == 0
    assert value(found, "vllm:prefix_cache_queries_total", **model) == 12  # four 3-token prompts
    # the engine core's phases of each request (vLLM's request_*_time_seconds), one observation each
    phases = ("queue", "prefill", "decode", "inference")
    for phase in phases:
        assert value(found, f"vllm:request_{phase}_time_seconds_count", **model) == 4
    seconds = {p: value(found, f"vllm:request_{p}_time_seconds_sum", **model) for p in phases}
    assert min(seconds.values()) >= 0
    assert seconds["inference"] == pytest.approx(seconds["prefill"] + seconds["decode"])
    # tokens per engine step: each request computes its 3-token prompt and 4 of its 5 tokens (the last
    # sampled one is never fed back), so 28 tokens over the steps, vLLM's buckets
    assert value(found, "vllm:iteration_tokens_total_sum", **model) == 28
    assert value(found, "vllm:iteration_tokens_total_bucket", le="16384.0", **model) == value(
        found, "vllm:iteration_tokens_total_count", **model
    )
    assert value(found, "vllm:prefix_cache_hits_total", **model) == 0  # shorter than a block: nothing to hit
    (config,) = [dict(labels) for name, labels in found if name == "vllm:cache_config_info"]
    assert config["block_size"] == "4" and config["enable_prefix_caching"] == "True"
    assert config["gpu_memory_utilization"] == "0.9" and config["num_cpu_blocks"] == "0"
    # residency for the gateway: adapter a@1 ran, so it holds a GPU slot and sits in the CPU tier
    for tier in ("gpu", "cpu", "disk"):
        assert (
            value(found, "loraserve_adapter_resident", tenant="default", adapter="a", version="1", tier=tier)
            == 1
        )
    assert lora_info(found) == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    # The first request for the adapter missed every tier; the later ones hit the GPU slot.
    assert sum(v for (n, _), v in found.items() if n == "loraserve_adapter_cache_misses_total") >= 1
    assert sum(v for (n, _), v in found.items() if n == "loraserve_adapter_cache_hits_total") >= 1
    assert sum(v for (n, _), v in found.items() if n == "loraserve_adapter_load_seconds_count") >= 1
    # Adapter requests' engine-side TTFT by the tier their adapter came from: the routed request found it
    # only in the store (a cold start, counted once), the next two in its GPU slot.
    ttft = "loraserve_adapter_ttft_seconds_count"
    assert value(found, ttft, source_tier="store", **model) == 1
    assert value(found, ttft, source_tier="gpu", **model) == 2
    assert value(found, "loraserve_adapter_cold_start_seconds_count", source_tier="store", **model) == 1
    assert value(found, "loraserve_adapter_cold_start_seconds_sum", source_tier="store", **model) > 0
    assert "vllm:time_to_first_token_seconds_count" in before  # registered before any request
    assert ready.status_code == 200 and ready.json() == {"ready": True, "model": "tiny", "reasons": []}
    assert health.json() == {"status": "ok"}


def lora_info(found: dict) -> dict:
    """The labels of the one `vllm:lora_requests_info` series."""
    (labels,) = [labels for (name, labels) in found if name == "vllm:lora_requests_info"]
    return dict(labels)


@pytest.mark.parametrize(
    "adapter_ids, labelled",
    [
        ((), ""),
        (("default/a@1",), "a"),
        # Two versions of one adapter, and another tenant's adapter of the same name: `a` is listed once,
        # so the picker, which counts entries against max_lora, does not see more adapters than slots.
        (("alpha/a@2", "beta/a@1", "beta/b@3"), "a,b"),
        (("beta/b@3", "alpha/a@2", "beta/b@3"), "b,a"),
        (("alpha/x.y-1@10",), "x.y-1"),
        (("not-an-engine-id",), "not-an-engine-id"),
    ],
)
def test_affinity_names_are_the_model_names_clients_send(adapter_ids, labelled):
    assert affinity_names(adapter_ids) == labelled


def engine_stats(running: tuple[str, ...], waiting: tuple[str, ...]) -> EngineStats:
    return EngineStats(
        num_running=len(running),
        num_waiting=len(waiting),
        kv_cache_usage=0.5,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        running_adapters=running,
        waiting_adapters=waiting,
        max_loras=4,
        num_lora_slots_in_use=len(running),
        num_adapters_loading=0,
    )


def test_lora_requests_info_is_shaped_as_vllm_exports_it():
    """What the Inference Extension's endpoint picker parses: one series, value the scrape time (it keeps
    the newest series), `max_lora` an integer, adapter lists joined by "," with no spaces."""
    stats = engine_stats(running=("alpha/a@2", "beta/b@1"), waiting=("alpha/a@2", "alpha/c@7"))
    metrics = Metrics("tiny", engine_stats=lambda: stats)
    before = time.time()
    text = metrics.render().decode()
    found = samples(text)
    assert lora_info(found) == {
        "max_lora": "4",
        "running_lora_adapters": "a,b",
        "waiting_lora_adapters": "a,c",
    }
    (stamp,) = [v for (name, _), v in found.items() if name == "vllm:lora_requests_info"]
    assert before <= stamp <= time.time()
    assert "# TYPE vllm:lora_requests_info gauge" in text


def test_adapter_latency_histograms_carry_the_source_tier_and_no_names():
    counts = HistogramCounts((0.1, 1.0), (2, 1, 0), 0.35)
    stats = dataclasses.replace(
        engine_stats(running=(), waiting=()),
        adapter_ttft=(("gpu", counts), ("store", HistogramCounts((0.1, 1.0), (0, 0, 1), 2.5))),
        adapter_cold_start=(("store", HistogramCounts((0.1, 1.0), (0, 1, 0), 0.5)),),
    )
    found = samples(Metrics("tiny", engine_stats=lambda: stats).render().decode())
    ttft = "loraserve_adapter_ttft_seconds"
    assert value(found, f"{ttft}_bucket", model_name="tiny", source_tier="gpu", le="0.1") == 2
    assert value(found, f"{ttft}_bucket", model_name="tiny", source_tier="gpu", le="1.0") == 3
    assert value(found, f"{ttft}_count", model_name="tiny", source_tier="gpu") == 3
    assert value(found, f"{ttft}_sum", model_name="tiny", source_tier="gpu") == pytest.approx(0.35)
    assert value(found, f"{ttft}_bucket", model_name="tiny", source_tier="store", le="+Inf") == 1
    cold = "loraserve_adapter_cold_start_seconds"
    assert value(found, f"{cold}_count", model_name="tiny", source_tier="store") == 1
    labels = {
        key
        for name, labels in found
        if name.startswith(("loraserve_adapter_ttft", cold))
        for key, _ in labels
    }
    assert labels == {"model_name", "source_tier", "le"}  # bounded: never an adapter or tenant name


def test_the_kv_tier_is_a_tier_label_and_its_blocks_a_gauge():
    stats = replace(
        engine_stats((), ()),
        num_kv_adapters=3,
        num_kv_adapter_blocks=24,
        adapter_cold_start=(("kv", HistogramCounts((0.1, 1.0), (2, 0, 0), 0.002)),),
    )
    metrics = Metrics("tiny", engine_stats=lambda: stats)
    metrics.adapter_event("miss", "gpu")
    metrics.adapter_event("hit", "kv")
    metrics.adapter_event("load", "kv", 0.0001)
    metrics.adapter_event("evict", "kv")
    found = samples(metrics.render().decode())
    assert value(found, "loraserve_adapter_kv_cache_blocks", model_name="tiny") == 24
    assert value(found, "loraserve_adapter_kv_cache_adapters", model_name="tiny") == 3
    assert value(found, "loraserve_adapter_cache_hits_total", tier="kv") == 1
    assert value(found, "loraserve_adapter_load_seconds_count", tier="kv") == 1
    assert value(found, "loraserve_adapter_evictions_total", tier="kv") == 1
    assert (
        value(found, "loraserve_adapter_cold_start_seconds_count", model_name="tiny", source_tier="kv") == 2
    )


def test_moe_routing_is_exported_per_expert():
    stats = replace(engine_stats((), ()), moe_expert_tokens=(5, 0, 7), moe_load_imbalance=1.75)
    found = samples(Metrics("tiny", engine_stats=lambda: stats).render().decode())
    assert value(found, "loraserve_moe_expert_tokens_total", model_name="tiny", expert="2") == 7
    assert value(found, "loraserve_moe_load_imbalance", model_name="tiny") == 1.75
    dense = samples(Metrics("tiny", engine_stats=lambda: engine_stats((), ())).render().decode())
    assert not [name for name, _ in dense if name.startswith("loraserve_moe")]


@pytest.mark.slow
def test_lora_requests_info_names_a_running_adapter_as_requests_name_it(tmp_path, model_dir, adapter_dir):
    async def scenario(client, services):
        services.adapter_store.put("default", "a", adapter_dir)
        body = {"model": "a", "prompt": [4, 5, 6], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        seen = []
        while not request.done():  # scrape until one scrape lands while the request runs
            info = lora_info(samples((await client.get(METRICS_URL)).text))
            if info["running_lora_adapters"]:
                seen.append(info)
                break
            await asyncio.sleep(0.001)
        return seen, await request

    seen, response = run(tmp_path, model_dir, scenario)
    assert response.status_code == 200 and response.json()["model"] == "a@1"
    assert seen == [{"max_lora": "2", "running_lora_adapters": "a", "waiting_lora_adapters": ""}]


@pytest.mark.slow
def test_ready_reports_an_unreachable_adapter_store_without_failing_or_waiting(tmp_path, model_dir):
    """The store is shared by every replica: its outage must not take them all out of the load balancer,
    a hung store must not hang the probe, and the body names no path (anyone may read /ready)."""

    async def scenario(client, services):
        def broken():
            raise OSError("disk gone at /secret/place")

        services.adapter_store.check = broken
        first = await client.get("/ready")  # starts the background check
        await asyncio.sleep(0.2)
        second = await client.get("/ready")
        hung = threading.Event()
        services.adapter_store.check = hung.wait
        app_readiness = Readiness(interval_s=0.0)
        started = time.monotonic()
        probes = [await app_readiness.check(services) for _ in range(3)]
        waited = time.monotonic() - started
        hung.set()
        return first, second, probes, waited

    first, second, probes, waited = run(tmp_path, model_dir, scenario)
    assert first.status_code == 200
    assert second.status_code == 200
    assert second.json() == {"ready": True, "model": "tiny", "reasons": [], "degraded": [ADAPTER_STORE_DOWN]}
    assert "/secret" not in second.text
    assert all(p.ready for p in probes) and waited < 0.5


@pytest.mark.slow
def test_metrics_are_not_served_to_tenants_on_the_main_port(tmp_path, model_dir, adapter_dir):
    async def scenario(client, services):
        services.adapter_store.put("default", "a", adapter_dir)
        body = {"model": "a", "prompt": [4, 5, 6], "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        return (
            await client.get("/metrics"),
            await client.get(METRICS_URL),
            await client.post("http://testserver:8001/v1/completions", json=body),
            await client.get("http://testserver:8001/health"),
            await client.get("http://testserver:8001/ready"),
        )

    main, scrape, tenant_on_metrics_port, health, ready = run(tmp_path, model_dir, scenario)
    assert main.status_code == 404 and "default" not in main.text
    assert scrape.status_code == 200 and main.json()["error"]["code"] == "not_found"
    assert "loraserve_adapter_cache_misses_total" in scrape.text
    assert tenant_on_metrics_port.status_code == 404
    assert health.status_code == 200 and ready.status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("where", ["http://testserver", "http://testserver:8001"])
def test_a_scrape_key_guards_metrics_on_both_ports(tmp_path, model_dir, where):
    key = "scrape-key-0123456789abcdef"
    settings = ServerSettings(metrics_key=key)

    async def scenario(client, services):
        return (
            await client.get(f"{where}/metrics"),
            await client.get(f"{where}/metrics", headers={"Authorization": "Bearer wrong-key-0123456789"}),
            await client.get(f"{where}/metrics", headers={"Authorization": f"Bearer {key}"}),
        )

    missing, wrong, right = run(tmp_path, model_dir, scenario, settings=settings)
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert right.status_code == 200 and "vllm:num_requests_running" in right.text


def test_metrics_settings():
    assert ServerSettings().metrics_listen_port == 8001
    assert ServerSettings(port=9000).metrics_listen_port == 9001
    assert ServerSettings(port=0).metrics_listen_port is None
    assert ServerSettings(metrics_port=METRICS_OFF).metrics_listen_port is None
    assert ServerSettings(metrics_port=9100).metrics_listen_port == 9100
    with pytest.raises(ValueError, match="--metrics-port"):
        ServerSettings(port=9000, metrics_port=9000)
    with pytest.raises(ValueError, match="--metrics-key"):
        ServerSettings(metrics_key="short")
