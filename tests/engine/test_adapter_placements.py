"""An operator's placements: adapters preloaded into a GPU slot (or the CPU tier) without a request, pinned
there against every other adapter's requests, unpinned and unloaded; the residency EngineStats reports.
Tokens served by a pinned adapter are checked against transformers + PEFT."""

from __future__ import annotations

import time

import pytest
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora.residency import AdapterStatus
from engine.stats import AdapterResidency

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("placements")
    model_dir = make_model(root / "model", seed=9)
    configs = list(C1_ADAPTERS.values())
    adapters = {
        f"ad{i}": make_adapter(model_dir, root / f"ad{i}", seed=300 + i, **configs[i % len(configs)])
        for i in range(5)
    }
    return dict(model_dir=model_dir, adapters=adapters)


def make_engine(case, events: list | None = None, **overrides) -> LLMEngine:
    args = dict(model=str(case["model_dir"]), max_loras=3, max_lora_rank=16, block_size=8, max_model_len=64)
    observer = None if events is None else (lambda event, tier, seconds=0.0: events.append((event, tier)))
    engine = LLMEngine(
        EngineConfig(**{**args, "dtype": "float32", **overrides}),
        skip_tokenizer_init=True,
        adapter_observer=observer,
    )
    for name, path in case["adapters"].items():
        engine.register_adapter(name, str(path))
    return engine


def until(engine: LLMEngine, check, timeout_s: float = 30.0) -> None:
    """Advance an idle engine (as the core's idle loop does) until `check()`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, engine.stats().lora_residency
        engine.advance_adapters()
        time.sleep(0.01)


def residency(engine: LLMEngine) -> dict[str, AdapterResidency]:
    return {r.adapter_id: r for r in engine.stats().lora_residency}


def run(engine: LLMEngine, requests: list[tuple[str, str]]) -> dict[str, list[int]]:
    for request_id, adapter in requests:
        engine.add_request(request_id, PROMPT, GREEDY, adapter)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                tokens[output.request_id] = output.outputs[0].token_ids
    return tokens


@pytest.mark.slow
def test_a_pinned_adapter_survives_every_other_adapters_requests(case):
    engine = make_engine(case)
    try:
        engine.preload_adapters(["ad0"], level="gpu", pin=True)
        until(engine, lambda: engine.lora.status("ad0") is AdapterStatus.PINNED)
        assert residency(engine)["ad0"] == AdapterResidency(
            "ad0", "gpu", True, 4, placed=True, in_cpu_tier=True
        )
        # four other adapters through the two slots left, one at a time and then all at once
        for i in range(1, 5):
            run(engine, [(f"solo{i}", f"ad{i}")])
            assert engine.lora.status("ad0") is AdapterStatus.PINNED
        tokens = run(engine, [(f"mix{i}", f"ad{i}") for i in range(5)])
        assert engine.lora.status("ad0") is AdapterStatus.PINNED and residency(engine)["ad0"].placed
        reference = load_peft_reference(case["model_dir"], {"ad0": case["adapters"]["ad0"]})
        assert tokens["mix0"] == reference_greedy(reference, PROMPT, "ad0", GREEDY.max_tokens)

        engine.unpin_adapters(["ad0"])  # resident, evictable: the next two adapters take its slot
        assert residency(engine)["ad0"].pinned is False and residency(engine)["ad0"].placed is False
        run(engine, [("x1", "ad1"), ("x2", "ad2"), ("x3", "ad3")])
        assert engine.lora.status("ad0") is not AdapterStatus.RESIDENT
    finally:
        engine.shutdown()


def test_unload_frees_the_slot_and_the_cpu_row(case):
    engine = make_engine(case)
    try:
        engine.preload_adapters(["ad1", "ad2"], level="gpu")  # no pin: resident, evictable
        until(engine, lambda: {"ad1", "ad2"} <= set(engine.lora.gpu_ids()))
        assert not any(r.pinned or r.placed for r in residency(engine).values())
        engine.preload_adapters(["ad1"], level="gpu", pin=True)
        until(engine, lambda: residency(engine)["ad1"].placed)
        engine.unpin_adapters(["ad1", "ad2", "unknown"], unload=True)
        assert set(residency(engine)) == set()
        assert engine.lora.status("ad1") is None and engine.lora.status("ad2") is None
    finally:
        engine.shutdown()


def test_operator_pins_leave_a_slot_for_requests(case):
    """max_loras 2: one pin at most; a second one stays resident but unpinned, so other adapters still run."""
    engine = make_engine(case, max_loras=2)
    try:
        # both in the CPU tier first: placements pin in their order only among adapters whose loads
        # finished, and the two loads race on the loader threads
        engine.preload_adapters(["ad0", "ad1"], level="cpu")
        until(engine, lambda: {"ad0", "ad1"} <= set(engine.lora.cpu_ids()))
        engine.preload_adapters(["ad0", "ad1"], level="gpu", pin=True)
        until(engine, lambda: not engine.lora.placements())
        assert [r.adapter_id for r in residency(engine).values() if r.placed] == ["ad0"]
        assert run(engine, [("other", "ad3")])["other"]  # served through the slot left
    finally:
        engine.shutdown()


def test_a_cpu_preload_counts_no_lookup_and_deleting_drops_a_pin(case):
    events: list = []
    engine = make_engine(case, events)
    try:
        engine.preload_adapters(["ad3"])  # level cpu
        until(engine, lambda: engine.lora.status("ad3") is AdapterStatus.CPU)
        assert residency(engine)["ad3"].level == "cpu" and residency(engine)["ad3"].rank == 16
        assert not [e for e in events if e[0] in ("hit", "miss")]  # hits and misses count requests
        engine.preload_adapters(["ad3"], level="gpu", pin=True)
        until(engine, lambda: engine.lora.status("ad3") is AdapterStatus.PINNED)
        engine.forget_adapter("ad3")  # deleted: its pin goes, and so does it
        assert "ad3" not in residency(engine) and "ad3" not in engine.lora.operator_pins
        with pytest.raises(ValueError, match="only an adapter preloaded into a GPU slot"):
            engine.preload_adapters(["ad1"], pin=True)
        with pytest.raises(ValueError, match="level must be one of cpu, gpu"):
            engine.preload_adapters(["ad1"], level="disk")
    finally:
        engine.shutdown()
