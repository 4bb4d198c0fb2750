"""The placement loop's parts: views parsed from real /metrics text, demand from counters, the plan (table
driven), and a round's calls to the residency endpoints (over httpx.MockTransport)."""

from __future__ import annotations

import json

import httpx
import pytest
from loraserve.cli import build_parser
from loraserve.ops.metrics import Metrics
from loraserve.placement.command import replica_source
from loraserve.placement.loop import PlacementLoop, PlacementSettings
from loraserve.placement.plan import Action, Demand, actions, plan
from loraserve.placement.views import ReplicaView, parse_view

from engine import EngineStats
from engine.stats import AdapterResidency


def view(url, max_gpu=4, gpu=(), cpu=(), placed=(), requests=None) -> ReplicaView:
    return ReplicaView(url, max_gpu, frozenset(gpu), frozenset(cpu), dict(requests or {}), frozenset(placed))


def test_a_view_reads_what_a_replica_exports():
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        running_adapters=("t/a@2",),
        waiting_adapters=(),
        max_loras=3,
        num_lora_slots_in_use=1,
        num_adapters_loading=0,
        lora_residency=(
            AdapterResidency("t/a@2", "gpu", True, 8, placed=True),
            AdapterResidency("t/b@1", "cpu", False, 8, in_cpu_tier=True),
        ),
    )
    metrics = Metrics("tiny", engine_stats=lambda: stats)
    for _ in range(3):
        metrics.adapter_request("t/a@2")
    metrics.adapter_request("u/c@1")
    residency = {"adapters": [{"adapter": "t/a@2", "adapter_name": "t/a", "placed": True}]}
    assert parse_view("http://r0:8001", metrics.render().decode(), residency) == view(
        "http://r0:8001", 3, gpu={"t/a"}, cpu={"t/b"}, placed={"t/a"}, requests={"t/a": 3.0, "u/c": 1.0}
    )
    with pytest.raises(ValueError, match="no vllm:max_gpu_lora_adapters"):
        parse_view("http://r0:8001", "", {})


def test_demand_counts_deltas_smoothed_and_survives_restarts():
    demand = Demand(smoothing=0.5)
    assert demand.update([view("r0", requests={"a": 4}), view("r1", requests={"a": 2, "b": 2})]) == {
        "a": 3.0,
        "b": 1.0,
    }
    # r1 restarted (its counter fell): its new count counts whole; a got 2 more on r0
    assert demand.update([view("r0", requests={"a": 6}), view("r1", requests={"a": 1})]) == {
        "a": 0.5 * 3 + 0.5 * 3,
        "b": 0.5,
    }
    for _ in range(30):  # no more requests: rates decay to nothing and are dropped
        rates = demand.update([view("r0", requests={"a": 6}), view("r1", requests={"a": 1})])
    assert rates == {}


R = [view("r0", gpu={"a"}), view("r1"), view("r2", cpu={"c"})]


@pytest.mark.parametrize(
    ("views", "rates", "copies", "budget", "pins"),
    [
        # the docstring's worked example
        (
            R,
            {"a": 9, "b": 5, "c": 2, "d": 0.05},
            2,
            2,
            {"r0": {"a", "b"}, "r1": {"a", "c"}, "r2": {"b", "c"}},
        ),
        # k = 1 spreads the hottest over replicas; budget 0 pins nothing
        (R, {"a": 9, "b": 5, "c": 2}, 1, 1, {"r0": {"a"}, "r1": {"b"}, "r2": {"c"}}),
        (R, {"a": 9}, 2, 0, {"r0": set(), "r1": set(), "r2": set()}),
        # more copies than replicas: every replica, once
        (R, {"a": 9}, 5, 1, {"r0": {"a"}, "r1": {"a"}, "r2": {"a"}}),
        # max_loras 2 leaves one pin per replica whatever the budget; max_loras 1 none
        ([view("r0", max_gpu=2), view("r1", max_gpu=1)], {"a": 3, "b": 2}, 1, 4, {"r0": {"a"}, "r1": set()}),
        # what a replica pins already keeps its place (no churn) before residency and spread
        (
            [view("r0", gpu={"b"}), view("r1", placed={"b"})],
            {"b": 1},
            1,
            1,
            {"r0": set(), "r1": {"b"}},
        ),
        # hysteresis: a pin among the band (twice what fits) stays, though hotter adapters have none...
        (
            [view("r0", placed={"c"}), view("r1")],
            {"a": 9, "b": 5, "c": 2, "d": 1, "e": 0.5},
            1,
            1,
            {"r0": {"c"}, "r1": {"a"}},
        ),
        # ...and one pushed out of the band is unpinned
        (
            [view("r0", placed={"e"}), view("r1")],
            {"a": 9, "b": 5, "c": 2, "d": 1, "e": 0.5},
            1,
            1,
            {"r0": {"a"}, "r1": {"b"}},
        ),
        # equal rates: by name, so every round plans the same
        ([view("r0"), view("r1")], {"y": 1, "x": 1}, 1, 1, {"r0": {"x"}, "r1": {"y"}}),
    ],
)
def test_plan(views, rates, copies, budget, pins):
    assert plan(views, rates, copies, budget, min_rate=0.1) == {u: frozenset(p) for u, p in pins.items()}


def test_actions_unpin_first_then_pin():
    views = [view("r0", placed={"a", "old"}), view("r1")]
    assert actions(views, {"r0": frozenset({"a", "b"}), "r1": frozenset({"a"})}) == [
        Action("r0", "unpin", "old"),
        Action("r0", "pin", "b"),
        Action("r1", "pin", "a"),
    ]


def test_a_round_calls_the_residency_endpoints_and_skips_a_dead_replica():
    calls = []
    hot = Metrics("tiny", engine_stats=lambda: _stats(max_loras=3))
    for _ in range(5):
        hot.adapter_request("t/hot@1")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dead":
            raise httpx.ConnectError("refused", request=request)
        if request.url.host == "nokey" and request.url.path == "/v1/residency":
            return httpx.Response(404, json={})
        key = "scrape-key" if request.url.path == "/metrics" else "placement-key-0123456789"
        assert request.headers.get("authorization") == f"Bearer {key}"
        if request.url.path == "/metrics":
            return httpx.Response(200, text=hot.render().decode() if request.url.host == "r0" else _empty())
        if request.url.path == "/v1/residency":
            placed = [{"adapter_name": "t/cold", "placed": True}] if request.url.host == "r1" else []
            return httpx.Response(200, json={"adapters": placed})
        calls.append((request.url.host, request.url.path, json.loads(request.content)))
        return httpx.Response(202 if request.url.path.endswith("preload") else 200, json={})

    loop = PlacementLoop(
        lambda: ["http://r0", "http://r1", "http://dead", "http://nokey"],
        PlacementSettings(copies=2, budget=1, unload_cold=True),
        "placement-key-0123456789",
        "scrape-key",
        client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    result = loop.run_once()
    assert [v.url for v in result.views] == ["http://r0", "http://r1"]
    assert result.unreachable[0].startswith("http://dead: ")
    assert (
        result.unreachable[1]
        == "http://nokey: it serves no residency endpoints: start it with --placement-key"
    )
    assert calls == [
        ("r1", "/v1/residency/unpin", {"adapter": "t/cold", "unload": True}),
        ("r0", "/v1/residency/preload", {"adapter": "t/hot", "level": "gpu", "pin": True}),
        ("r1", "/v1/residency/preload", {"adapter": "t/hot", "level": "gpu", "pin": True}),
    ]


def _stats(max_loras: int) -> EngineStats:
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        running_adapters=(),
        waiting_adapters=(),
        max_loras=max_loras,
        num_lora_slots_in_use=0,
        num_adapters_loading=0,
    )


def _empty() -> str:
    return Metrics("tiny", engine_stats=lambda: _stats(max_loras=3)).render().decode()


def test_the_command_line_and_its_environment(monkeypatch):
    parser = build_parser({"LORASERVE_PLACEMENT_KEY": "k" * 20, "LORASERVE_COPIES": "3"})
    args = parser.parse_args(["placement", "--replica", "10.0.0.7:8001", "http://r1:8001/", "--budget", "2"])
    assert (args.placement_key, args.copies, args.budget, args.interval) == ("k" * 20, 3, 2, 15.0)
    assert replica_source(args.replica, None)() == ["http://10.0.0.7:8001", "http://r1:8001"]
    assert replica_source([], "localhost:8001")()[0] in ("http://127.0.0.1:8001", "http://[::1]:8001")
    with pytest.raises(ValueError, match="HOST:PORT"):
        replica_source([], "no-port")
    with pytest.raises(ValueError, match="--copies must be at least 1"):
        PlacementSettings(copies=0)
