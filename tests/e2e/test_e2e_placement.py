"""`loraserve placement` against three real `loraserve serve` processes on loopback: on a Zipf workload it
cuts cold starts and adapter loads, and every answer is the same (greedy).

The replicas share one adapter store (two GPU slots and two CPU-tier rows each) and are reached round
robin, as a plain Kubernetes Service does (routing that does not follow residency: the case placement is
for; docs/OPERATIONS.md, "Placement"). One arm runs the placement loop (`copies=3, budget=1`: the
hottest adapter pinned on every replica) every 12 requests after 12 requests of warm-up; the other runs
the same requests without it. Each arm has its own copies of the adapters (same weights, other names),
so neither arm inherits the other's caches or counters. Each replica takes its requests one at a time
and routing is fixed, so the residency each request meets is the same on every run (measured here:
28 cold starts, 25 CPU-tier loads, 28 GPU copies with the loop against 34, 34, 34 without). Cold starts are the replicas' GPU misses
(`loraserve_adapter_cache_misses_total{tier="gpu"}`), loads the loads into the CPU tier
(`vllm:lora_adapter_load_seconds_count`) and into GPU slots (`loraserve_adapter_load_seconds_count{tier="cpu"}`),
summed over the replicas, the placement loop's own pre-loads included.

One replica also publishes KV events (`--kv-events-config`), which a consumer follows: the stored blocks
name the adapters by their tenant-qualified names.
"""

from __future__ import annotations

import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from kv_events_consumer import Consumer
from loraserve.placement.loop import PlacementLoop, PlacementSettings
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from factories import make_adapter  # noqa: E402
from server_process import ServerProcess, tiny_server_args  # noqa: E402

from adapter_format.model_shape import ModelShape  # noqa: E402
from adapters_store import StoreConfig, open_store  # noqa: E402
from engine.model.loader import load_config  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "placement-key-0123456789"
OPERATOR = {"authorization": f"Bearer {KEY}"}
NUM_ADAPTERS, ZIPF_S, SEED = 30, 1.5, 13  # a fixed Zipf sequence: the hottest adapter takes ~40%
NUM_REQUESTS, WARM_UP, EVERY = 48, 12, 12
GPU_MISS = ("loraserve_adapter_cache_misses_total", {"tier": "gpu"})
CPU_LOADS = ("vllm:lora_adapter_load_seconds_count", {})
GPU_COPIES = ("loraserve_adapter_load_seconds_count", {"tier": "cpu"})


@dataclass
class Arm:
    answers: list[str] = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)  # counter deltas summed over the replicas
    pins: list[dict] = field(default_factory=list)  # each round's plan


def counters(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
    found = {"cold starts": 0.0, "CPU-tier loads": 0.0, "GPU copies": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label, (name, labels) in zip(found, (GPU_MISS, CPU_LOADS, GPU_COPIES)):
                if sample.name == name and labels.items() <= sample.labels.items():
                    found[label] += sample.value
    return found


def residency(server: ServerProcess) -> list[dict]:
    return httpx.get(f"{server.metrics_url}/v1/residency", headers=OPERATOR, timeout=10).json()["adapters"]


def quiet(servers: list[ServerProcess], timeout_s: float = 30.0) -> None:
    """Wait until no replica runs, waits for or loads anything (their stats are published after each step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for server in servers:
            text = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if (
                        sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
                        and sample.value
                    ):
                        busy = True
        if not busy:
            time.sleep(0.2)
            return
        time.sleep(0.05)
    raise AssertionError("the replicas did not go quiet")


def wait_for_pins(
    servers: list[ServerProcess], desired: dict[str, frozenset[str]], timeout_s: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout_s
    for server in servers:
        want = desired.get(server.metrics_url, frozenset())
        while {a["adapter_name"] for a in residency(server) if a["placed"]} != want:
            assert time.monotonic() < deadline, (server.metrics_url, residency(server), want)
            time.sleep(0.05)


def run_arm(servers, arm: str, sequence, prompts, loop: PlacementLoop | None) -> Arm:
    """Request t goes to replica t % 3. Each replica's requests run one after another, in order, and the
    three replicas' run side by side (a replica's residency depends only on its own requests and the
    pins, which land between groups), so every run meets the same residency, only sooner."""
    result = Arm(answers=[""] * len(sequence))
    before = [counters(s) for s in servers]

    def ask(t: int) -> None:
        body = {
            "model": f"{arm}-{sequence[t]}",
            "prompt": prompts[t],
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{servers[t % 3].url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        result.answers[t] = response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(servers)) as pool:
        for start in range(0, len(sequence), len(servers)):
            if loop is not None and start >= WARM_UP and (start - WARM_UP) % EVERY == 0:
                quiet(servers)
                round_ = loop.run_once()
                assert not round_.unreachable and not round_.failed, (round_.unreachable, round_.failed)
                wait_for_pins(servers, round_.desired)
                result.pins.append({url: sorted(names) for url, names in round_.desired.items()})
            list(pool.map(ask, range(start, min(start + len(servers), len(sequence)))))
    quiet(servers)
    after = [counters(s) for s in servers]
    result.totals = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in before[0]}
    return result


def test_placement_cuts_cold_starts_and_loads_with_the_same_answers(tmp_path):
    model_dir = make_text_model(tmp_path / "model")
    weights = [make_adapter(model_dir, tmp_path / f"w{i}", seed=60 + i, r=4 * (i + 1)) for i in range(3)]
    store_dir = tmp_path / "store"
    store = open_store(
        StoreConfig(url=f"file://{store_dir}", max_lora_rank=16),
        ModelShape.from_hf_config(load_config(model_dir)),
    )
    for arm in ("placed", "plain"):
        for i in range(NUM_ADAPTERS):
            store.put("default", f"{arm}-{i}", weights[i % len(weights)])
    rng = random.Random(SEED)
    sequence = rng.choices(
        range(NUM_ADAPTERS), [1 / (i + 1) ** ZIPF_S for i in range(NUM_ADAPTERS)], k=NUM_REQUESTS
    )
    prompts = [[rng.randrange(3, 250) for _ in range(4)] for _ in range(NUM_REQUESTS)]

    events = f"ipc://{tmp_path}/kv-events"
    servers = []
    for i in range(3):
        workdir = tmp_path / f"replica{i}"
        workdir.mkdir()
        extra = ["--adapter-store", f"file://{store_dir}", "--max-cpu-loras", "2", "--placement-key", KEY]
        if i == 0:
            config = {
                "enable_kv_cache_events": True,
                "endpoint": events,
                "replay_endpoint": f"{events}-replay",
            }
            extra += ["--kv-events-config", json.dumps(config)]
        servers.append(ServerProcess(workdir, tiny_server_args(model_dir, *extra)))
    consumer = None
    loop = None
    try:
        for server in servers:  # three engines start at once: give a busy machine longer than one needs
            server.wait_ready(timeout_s=600)
        consumer = Consumer(events, f"{events}-replay")
        urls = [s.metrics_url for s in servers]
        loop = PlacementLoop(lambda: urls, PlacementSettings(copies=3, budget=1, min_rate=1.0), KEY)
        placed = run_arm(servers, "placed", sequence, prompts, loop)
        for server in servers:  # the placed arm's adapters leave every tier before the plain arm runs
            for adapter in residency(server):
                body = {"adapter": adapter["adapter"], "unload": True}
                assert httpx.post(
                    f"{server.metrics_url}/v1/residency/unpin", json=body, headers=OPERATOR
                ).is_success
        quiet(servers)
        assert not any(residency(s) for s in servers)
        plain = run_arm(servers, "plain", sequence, prompts, None)

        consumer.settle()
        consumer.fill_gaps()
        stored = [e for e in consumer.events() if e.kind == "BlockStored"]
        # None: base-model blocks (the serving warm-up's before /ready, docs/OPERATIONS.md)
        names = {e.fields["lora_name"] for e in stored} - {None}
    finally:
        if loop is not None:
            loop.close()
        if consumer is not None:
            consumer.close()
        for server in servers:
            server.stop()

    hottest = f"default/placed-{max(set(sequence), key=sequence.count)}"
    assert all(pins == {url: [hottest] for url in urls} for pins in placed.pins), placed.pins
    assert placed.answers == plain.answers  # same weights, same prompts, greedy: same text on any replica
    report = f"with placement {placed.totals}, without {plain.totals}"
    print(report)
    assert placed.totals["cold starts"] < plain.totals["cold starts"], report
    assert placed.totals["CPU-tier loads"] < plain.totals["CPU-tier loads"], report
    assert placed.totals["GPU copies"] < plain.totals["GPU copies"], report
    # replica 0 served a third of the requests; its KV events name their adapters tenant-qualified
    served = {f"default/{arm}-{index}" for arm in ("placed", "plain") for index in sequence[::3]}
    assert names and names <= served, names
