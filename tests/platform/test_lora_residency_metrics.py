"""vLLM's residency series (`vllm:lora_adapter_loaded` and its counts, `vllm:lora_adapter_load_seconds`),
scraped through prometheus_client's text parser while adapters load and are evicted, checked against the
engine's residency records and against our own `loraserve_adapter_resident`; tenant-qualified names."""

from __future__ import annotations

import asyncio

import pytest
from app_fixtures import keys_for, make_text_model
from factories import make_adapter
from loraserve.ops.lora_residency_metrics import loaded_adapters
from loraserve.ops.metrics import Metrics
from loraserve.settings import ServerSettings
from prometheus_client.parser import text_string_to_metric_families
from test_inference_completions import run

from engine import EngineStats
from engine.stats import AdapterResidency

METRICS_URL = "http://testserver:8001/metrics"
PLACEMENT_URL = "http://testserver:8001/v1/residency"
PLACEMENT_KEY = "placement-key-0123456789"
KEYS = keys_for(alpha=("sk-alpha", "admin", None), beta=("sk-beta", "admin", None))
ALPHA, BETA = ({"authorization": f"Bearer {key}"} for key in ("sk-alpha", "sk-beta"))
BODY = {"prompt": [4, 5, 6], "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("residency") / "model")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("residency-adapters")
    return {
        rank: make_adapter(model_dir, root / f"r{rank}", seed=rank, r=rank, lora_alpha=2 * rank)
        for rank in (4, 8, 16)
    }


def scrape(text: str) -> dict[str, list[tuple[dict, float]]]:
    """{metric family: [(labels, value), ...]} through prometheus_client's parser."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def loaded(found: dict) -> dict[tuple[str, str], tuple[str, str]]:
    """{(adapter_name, level): (pinned, rank)} from vllm:lora_adapter_loaded (each series is 1)."""
    series = found.get("vllm:lora_adapter_loaded", [])
    assert all(value == 1 and labels["model_name"] == "tiny" for labels, value in series)
    return {(la["adapter_name"], la["level"]): (la["pinned"], la["rank"]) for la, _ in series}


def gauge(found: dict, name: str) -> float:
    ((labels, value),) = found[name]
    assert labels == {"model_name": "tiny"}
    return value


def expected_from_records(records: tuple[AdapterResidency, ...]) -> dict[tuple[str, str], tuple[str, str]]:
    """The engine's records as vLLM's series, spelled out here: tenant/name, closest level, pins, rank."""
    expected: dict = {}
    for r in records:
        name = r.adapter_id.rpartition("@")[0]
        pinned, rank = expected.get((name, r.level), ("false", "0"))
        pinned = "true" if r.pinned or pinned == "true" else "false"
        expected[(name, r.level)] = (pinned, str(max(int(rank), r.rank)))
    return expected


@pytest.mark.slow
def test_residency_series_follow_loads_and_evictions(tmp_path, model_dir, adapters):
    """max_loras 2 and a CPU tier of 2: three adapters of two tenants, one after another, then a pin."""
    settings = ServerSettings(placement_key=PLACEMENT_KEY)
    operator = {"authorization": f"Bearer {PLACEMENT_KEY}"}

    async def scenario(client, services):
        store = services.adapter_store
        store.put("alpha", "a", adapters[4])
        store.put("alpha", "b", adapters[8])
        store.put("beta", "a", adapters[16])  # the same name, another tenant: its own series
        snapshots = []

        async def settle_and_scrape():
            for _ in range(400):  # the core publishes its stats just after a request's last step
                stats = services.engine.stats()
                if stats.num_running == 0 and stats.num_adapters_loading == 0:
                    break
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            text = (await client.get(METRICS_URL)).text
            snapshots.append((services.engine.stats(), scrape(text)))

        for model, headers in (("a", ALPHA), ("alpha/b", ALPHA), ("beta/a", BETA)):
            response = await client.post("/v1/completions", json={**BODY, "model": model}, headers=headers)
            assert response.status_code == 200, response.text
            await settle_and_scrape()
        pin = {"adapter": "alpha/b", "level": "gpu", "pin": True}
        preloaded = await client.post(f"{PLACEMENT_URL}/preload", json=pin, headers=operator)
        assert preloaded.status_code == 202, preloaded.text
        for _ in range(400):
            if any(r.placed for r in services.engine.stats().lora_residency):
                break
            await asyncio.sleep(0.01)
        await settle_and_scrape()
        other = await client.post("/v1/completions", json={**BODY, "model": "alpha/a"}, headers=BETA)
        return snapshots, other

    snapshots, other = run(tmp_path, model_dir, scenario, settings, api_keys=KEYS)
    assert (
        other.status_code == 404 and "alpha/a" in other.json()["error"]["message"]
    )  # beta cannot name alpha's

    expected_steps = [
        {("alpha/a", "gpu"): ("false", "4")},
        {("alpha/a", "gpu"): ("false", "4"), ("alpha/b", "gpu"): ("false", "8")},
        # beta/a needs a slot and a CPU-tier row: alpha/a, the least recently used, gives up both
        {("alpha/b", "gpu"): ("false", "8"), ("beta/a", "gpu"): ("false", "16")},
        # the operator's pin on alpha/b
        {("alpha/b", "gpu"): ("true", "8"), ("beta/a", "gpu"): ("false", "16")},
    ]
    for (stats, found), expected in zip(snapshots, expected_steps, strict=True):
        assert loaded(found) == expected == expected_from_records(stats.lora_residency)
        assert gauge(found, "vllm:num_gpu_loaded_lora_adapters") == len(stats.gpu_adapters)
        assert gauge(found, "vllm:num_cpu_loaded_lora_adapters") == len(stats.cpu_adapters)
        assert gauge(found, "vllm:max_gpu_lora_adapters") == 2
        # in step with our own series, which say the same per tenant, name, version and tier
        ours = {
            (f"{labels['tenant']}/{labels['adapter']}", labels["tier"])
            for labels, value in found["loraserve_adapter_resident"]
            if labels["tier"] in ("gpu", "cpu") and value == 1
        }
        assert {key for key in expected if key[1] == "gpu"} <= ours
        assert ours == {(a.rpartition("@")[0], "gpu") for a in stats.gpu_adapters} | {
            (a.rpartition("@")[0], "cpu") for a in stats.cpu_adapters
        }
    found = snapshots[-1][1]
    assert gauge(found, "vllm:lora_adapter_load_seconds_count") == 3  # one load into the CPU tier each
    assert gauge(found, "vllm:lora_adapter_load_seconds_sum") > 0
    requests = {labels["adapter_name"]: value for labels, value in found["loraserve_lora_requests_total"]}
    assert requests == {"alpha/a": 1, "alpha/b": 1, "beta/a": 1}


@pytest.mark.parametrize(
    ("records", "series"),
    [
        ((), {}),
        (
            # two versions of one name on the GPU, one pinned by a request; another only in the CPU tier
            (
                AdapterResidency("t/a@1", "gpu", True, 8, in_cpu_tier=True),
                AdapterResidency("t/a@2", "gpu", False, 16),
                AdapterResidency("t/b@3", "cpu", False, 4, in_cpu_tier=True),
                AdapterResidency("u/b@1", "gpu", False, 4, placed=True),
            ),
            {("t/a", "gpu"): (True, 16), ("t/b", "cpu"): (False, 4), ("u/b", "gpu"): (False, 4)},
        ),
    ],
)
def test_versions_of_one_name_merge_into_one_series(records, series):
    stats = EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        running_adapters=(),
        waiting_adapters=(),
        max_loras=3,
        num_lora_slots_in_use=0,
        num_adapters_loading=0,
        lora_residency=records,
    )
    assert loaded_adapters(stats) == series
    found = scrape(Metrics("tiny", engine_stats=lambda: stats).render().decode())
    assert gauge(found, "vllm:num_gpu_loaded_lora_adapters") == sum(r.level == "gpu" for r in records)
    assert gauge(found, "vllm:num_cpu_loaded_lora_adapters") == sum(r.in_cpu_tier for r in records)
    assert gauge(found, "vllm:max_gpu_lora_adapters") == 3
    assert len(found.get("vllm:lora_adapter_loaded", [])) == len(series)
