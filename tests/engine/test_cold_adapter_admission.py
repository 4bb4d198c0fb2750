"""Admission never stalls on adapter loads: while a cold adapter loads, requests for resident adapters
run; the cold adapter's own requests are served within a bounded wait even under a stream of hot
requests; and the waiting queue is prefetched ahead of the GPU slots without evicting what its head
needs from the CPU tier."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from factories import make_adapter, make_model
from transformers import AutoConfig

from adapter_format.model_shape import ModelShape
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora.manager import AdapterManager
from engine.lora.pool import LoRAPool
from engine.lora.registry import AdapterRegistry
from engine.lora.residency import AdapterStatus

SHORT = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cold")
    model_dir = make_model(root / "model", seed=7)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=30 + i, r=4, target_modules=["q_proj", "v_proj"])
        for i, name in enumerate(("hot", "warm", "cold", "colder"))
    }
    return model_dir, adapters


class GatedRegistry(AdapterRegistry):
    """Loads of the adapters in `gates` wait for their event (a slow store download)."""

    gates: dict[str, threading.Event] = {}

    def load(self, adapter_id, read=None):
        gate = self.gates.get(adapter_id)
        if gate is not None:
            assert gate.wait(30), f"the test never opened {adapter_id}'s gate"
        return super().load(adapter_id, read)


def make_engine(folders, gates: dict[str, threading.Event], **overrides) -> LLMEngine:
    model_dir, adapters = folders

    def factory(shape, max_lora_rank):
        registry = GatedRegistry(shape, max_lora_rank)
        registry.gates = gates
        for name, path in adapters.items():
            registry.register(name, path)
        return registry

    args = dict(model=str(model_dir), max_loras=1, max_lora_rank=8, max_num_seqs=4, block_size=8)
    args.update(max_model_len=64, dtype="float32", adapter_loader="thread")
    config = EngineConfig(**{**args, **overrides})
    return LLMEngine(config, skip_tokenizer_init=True, adapter_source_factory=factory)


def step_collect(engine: LLMEngine, finished: dict[str, int], step: int) -> None:
    for output in engine.step():
        if output.finished:
            assert output.error is None, output.error
            finished[output.request_id] = step


def test_a_cold_adapter_never_blocks_resident_adapters_and_is_served_once_loaded(folders):
    gate = threading.Event()
    engine = make_engine(folders, {"cold": gate}, max_loras=2)
    try:
        engine.add_request("warm-up", PROMPT, SHORT, adapter="hot")
        finished: dict[str, int] = {}
        step = 0
        while engine.has_unfinished_requests():
            step_collect(engine, finished, step)
        # The cold request is first in the queue, the hot ones behind it.
        engine.add_request("cold-0", PROMPT, SHORT, adapter="cold")
        for i in range(6):
            engine.add_request(f"hot-{i}", PROMPT, SHORT, adapter="hot")
        deadline = time.monotonic() + 30
        while not all(f"hot-{i}" in finished for i in range(6)):
            assert time.monotonic() < deadline, "the hot requests stalled behind the cold adapter's load"
            step += 1
            step_collect(engine, finished, step)
        assert "cold-0" not in finished and engine.lora.status("cold") is AdapterStatus.LOADING
        gate.set()
        opened, deadline = step, time.monotonic() + 10
        while "cold-0" not in finished:
            assert time.monotonic() < deadline, "the cold adapter was not served within 10 s of its load"
            step += 1
            step_collect(engine, finished, step)
        assert finished["cold-0"] - opened < 30
    finally:
        gate.set()
        engine.shutdown()


def test_a_cold_adapter_is_not_starved_by_a_stream_of_resident_requests(folders):
    """One slot, held by "hot" as long as any hot request runs, and a new hot request every step: the
    cold request is passed over for at most fairness_max_bypass_steps steps, then admission waits for
    it, the hot requests drain, and it gets the slot."""
    engine = make_engine(folders, {}, max_loras=1, max_num_seqs=4, fairness_max_bypass_steps=4)
    try:
        finished: dict[str, int] = {}
        engine.add_request("hot-0", PROMPT, SHORT, adapter="hot")
        step_collect(engine, finished, 0)
        engine.add_request("cold-0", PROMPT, SHORT, adapter="cold")
        arrived = step = 1
        deadline = time.monotonic() + 30
        while "cold-0" not in finished:
            assert time.monotonic() < deadline, "the cold request starved"
            engine.add_request(f"hot-{step}", PROMPT, SHORT, adapter="hot")
            step_collect(engine, finished, step)
            step += 1
        assert finished["cold-0"] - arrived < 40
        assert sum(1 for r in finished if r.startswith("hot-")) > 0  # hot ones ran meanwhile
        while engine.has_unfinished_requests():
            step_collect(engine, finished, step)
    finally:
        engine.shutdown()


def _manager(folders, max_loras: int, max_cpu_loras: int) -> tuple[AdapterManager, AdapterRegistry]:
    model_dir, adapters = folders
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    slots = LoRAPool(shape, max_loras=max_loras, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    registry = AdapterRegistry(shape, 8)
    for name, path in adapters.items():
        registry.register(name, path)
    return AdapterManager(registry, slots, max_cpu_loras=max_cpu_loras), registry


def _settle(manager: AdapterManager) -> None:
    deadline = time.monotonic() + 10
    while manager.num_loading:
        assert time.monotonic() < deadline
        manager.wait_for_loads(0.1)
        assert manager.poll() == {}


def _run(manager: AdapterManager, adapter_id: str) -> None:
    """Hold, load, stage and pin: a request for it runs."""
    manager.hold(adapter_id)
    manager.prefetch(adapter_id)
    _settle(manager)
    manager.stage([adapter_id])
    manager.acquire(adapter_id)


def test_stage_starts_the_loads_of_the_queue_beyond_the_free_gpu_slots(folders):
    """Every slot is pinned, so the head ("warm", in the CPU tier) waits for one; the adapters behind
    it still start loading into the CPU tier instead of waiting for the head to get its slot."""
    manager, _ = _manager(folders, max_loras=1, max_cpu_loras=3)
    try:
        _run(manager, "hot")
        manager.hold("warm")
        manager.prefetch("warm")
        _settle(manager)
        manager.hold("cold")  # queued; its arrival's prefetch is what `stage` must not depend on
        manager.stage(["warm", "cold"])
        assert manager.status("warm") is AdapterStatus.CPU  # no slot for it yet
        assert manager.status("cold") is AdapterStatus.LOADING
        _settle(manager)
        assert manager.cpu_ids() == ("cold", "hot", "warm")
    finally:
        manager.shutdown()


def test_a_load_further_back_never_takes_the_row_of_an_adapter_waiting_for_a_slot(folders):
    """Two rows, one slot pinned by "hot": "warm" waits in the CPU tier for the slot. "cold" may take
    hot's row (hot is on the GPU), but "colder" finds no row it may take and waits, instead of evicting
    warm's, which the head of the queue is about to copy."""
    manager, _ = _manager(folders, max_loras=1, max_cpu_loras=2)
    events = []
    manager._observer = lambda event, tier, seconds: events.append((event, tier))
    try:
        _run(manager, "hot")
        manager.hold("warm")
        manager.prefetch("warm")
        _settle(manager)
        for adapter_id in ("cold", "colder"):
            manager.hold(adapter_id)
            manager.prefetch(adapter_id)
        _settle(manager)
        manager.stage(["warm", "cold", "colder"])
        _settle(manager)
        assert manager.status("warm") is AdapterStatus.CPU and manager.status("cold") is AdapterStatus.CPU
        assert manager.status("colder") is AdapterStatus.STORED
        assert events.count(("evict", "cpu")) == 1  # hot's row, nothing else
        # the running hot request ends: warm gets the slot, and its row (now backed by the GPU) may go
        manager.release("hot")
        manager.unhold("hot")
        manager.stage(["warm", "cold", "colder"])
        assert manager.is_ready("warm")
        manager.stage(["warm", "cold", "colder"])
        assert manager.status("colder") is AdapterStatus.LOADING
        _settle(manager)
        assert manager.status("warm") is AdapterStatus.RESIDENT and "warm" not in manager.cpu_ids()
    finally:
        manager.shutdown()
