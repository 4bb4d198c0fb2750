"""Cold adapters: concurrent requests for one cold adapter share one load, and the engine's adapter
latency histograms (TTFT and cold start by source tier) count what happened, tier by tier."""

from __future__ import annotations

import threading

import pytest
from factories import make_adapter, make_model

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora.cold_starts import ADAPTER_LATENCY_BUCKETS, SOURCE_TIERS, ColdStart, TierHistograms
from engine.lora.registry import AdapterRegistry

SHORT = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cold-starts")
    model_dir = make_model(root / "model", seed=5)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=40 + i, r=4, target_modules=["q_proj", "v_proj"])
        for i, name in enumerate(("one", "two", "remote"))
    }
    return model_dir, adapters


class CountingRegistry(AdapterRegistry):
    """Counts loads per adapter; "remote" says it came from the store; gated loads wait for their event."""

    def __init__(self, shape, max_lora_rank):
        super().__init__(shape, max_lora_rank)
        self.loads: dict[str, int] = {}
        self.gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def load(self, adapter_id, read=None):
        with self.lock:
            self.loads[adapter_id] = self.loads.get(adapter_id, 0) + 1
        gate = self.gates.get(adapter_id)
        if gate is not None:
            assert gate.wait(30), f"the test never opened {adapter_id}'s gate"
        if adapter_id == "remote" and hasattr(read, "came_from"):
            read.came_from("store")
        return super().load(adapter_id, read)


def make_engine(folders, **overrides) -> tuple[LLMEngine, CountingRegistry]:
    model_dir, adapters = folders
    made: list[CountingRegistry] = []

    def factory(shape, max_lora_rank):
        registry = CountingRegistry(shape, max_lora_rank)
        for name, path in adapters.items():
            registry.register(name, path)
        made.append(registry)
        return registry

    args = dict(model=str(model_dir), max_loras=1, max_lora_rank=8, max_num_seqs=8, block_size=8)
    args.update(max_model_len=64, dtype="float32", adapter_loader="thread", max_cpu_loras=4)
    engine = LLMEngine(
        EngineConfig(**{**args, **overrides}), skip_tokenizer_init=True, adapter_source_factory=factory
    )
    return engine, made[0]


def run_all(engine: LLMEngine) -> None:
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return
        for output in engine.step():
            assert output.error is None, output.error
    raise AssertionError("the requests did not finish in 500 steps")


def counts(pairs) -> dict[str, int]:
    """{tier: observations} of an EngineStats histogram field."""
    return {tier: sum(histogram.counts) for tier, histogram in pairs}


def test_concurrent_requests_for_one_cold_adapter_share_one_load(folders):
    engine, registry = make_engine(folders, max_loras=2)
    gate = threading.Event()
    registry.gates["one"] = gate
    try:
        for i in range(6):  # all arrive while the load waits at its gate
            engine.add_request(f"r{i}", PROMPT, SHORT, adapter="one")
        for _ in range(3):
            engine.step()  # every step sees the load still running: none starts another
        assert registry.loads == {"one": 1}
        gate.set()
        run_all(engine)
        assert registry.loads == {"one": 1}
        stats = engine.stats()
        assert counts(stats.adapter_cold_start) == {"disk": 1}  # one cold start, however many waited
        assert counts(stats.adapter_ttft) == {"disk": 6}
    finally:
        engine.shutdown()


def test_ttft_and_cold_start_by_source_tier(folders):
    # max_loras 1: a second adapter evicts the first from the GPU; without the KV tier, which would keep
    # it in KV blocks ("kv": tests/engine/test_adapter_kv_tier.py)
    engine, registry = make_engine(folders, enable_adapter_kv_cache=False)
    try:
        engine.add_request("cold", PROMPT, SHORT, adapter="one")  # local folder: "disk"
        run_all(engine)
        engine.add_request("warm", PROMPT, SHORT, adapter="one")  # in its GPU slot: "gpu"
        run_all(engine)
        engine.add_request("store", PROMPT, SHORT, adapter="remote")  # the source says "store"
        run_all(engine)
        engine.add_request("cpu", PROMPT, SHORT, adapter="one")  # evicted from the GPU, still in the CPU tier
        run_all(engine)
        engine.add_request("base", PROMPT, SHORT)  # no adapter: not an adapter request
        run_all(engine)
        stats = engine.stats()
        assert counts(stats.adapter_ttft) == {"gpu": 1, "cpu": 1, "disk": 1, "store": 1}
        assert counts(stats.adapter_cold_start) == {"cpu": 1, "disk": 1, "store": 1}
        assert registry.loads == {"one": 1, "remote": 1}  # the CPU tier served the last "one"
        for _, histogram in stats.adapter_ttft + stats.adapter_cold_start:
            assert histogram.bounds == ADAPTER_LATENCY_BUCKETS
            assert histogram.total > 0
    finally:
        engine.shutdown()


def test_tier_histograms_keep_labels_bounded():
    histograms = TierHistograms()
    histograms.observe("store", 0.2)
    histograms.observe("gpu", 0.004)
    histograms.observe("gpu", 0.5)
    snapshot = dict(histograms.snapshot())
    assert list(snapshot) == ["gpu", "store"]  # SOURCE_TIERS order, observed tiers only
    assert sum(snapshot["gpu"].counts) == 2 and snapshot["gpu"].total == pytest.approx(0.504)
    assert snapshot["store"].counts[ADAPTER_LATENCY_BUCKETS.index(0.2)] == 1  # le 0.2 holds 0.2
    with pytest.raises(ValueError, match="unknown source tier"):
        histograms.observe("acme/support@3", 1.0)  # never an adapter name
    assert ColdStart().tier == "cpu" and ColdStart("store").tier == "store"
    assert set(SOURCE_TIERS) == {"gpu", "kv", "cpu", "disk", "store"}
