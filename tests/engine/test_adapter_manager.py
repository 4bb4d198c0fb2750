"""The adapter manager through the engine: more adapters than slots, failed loads, hot swap, deletion,
and the stats the server's /metrics reads. Every generated token is checked against transformers + PEFT
greedy decoding with the request's adapter (`adapter_names=`)."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
from collections import Counter

import pytest
import torch
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy
from transformers import AutoConfig

from adapter_format.model_shape import TARGET_MODULES
from engine import AsyncLLM, EngineConfig, EngineStats, LLMEngine, ModelShape, SamplingParams
from engine.lora.manager import AdapterManager
from engine.lora.pool import LoRAPool
from engine.lora.registry import AdapterRegistry
from engine.stats import ITERATION_TOKEN_BUCKETS, HistogramCounts

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUM_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
LONG = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A C1-sized Llama, eight adapters cycling C1's four configs with fresh weights, and the reference."""
    root = tmp_path_factory.mktemp("manager")
    model_dir = make_model(root / "model", seed=5)
    configs = list(C1_ADAPTERS.values())
    adapters = {
        f"ad{i}": make_adapter(model_dir, root / f"ad{i}", seed=100 + i, **configs[i % len(configs)])
        for i in range(8)
    }
    reference = load_peft_reference(model_dir, adapters)
    memo: dict = {}

    def expected(prompt: list[int], adapter: str | None, num_tokens: int = NUM_NEW_TOKENS) -> list[int]:
        key = (tuple(prompt), adapter, num_tokens)
        if key not in memo:
            memo[key] = reference_greedy(reference, prompt, adapter, num_tokens)
        return memo[key]

    return dict(model_dir=model_dir, adapters=adapters, expected=expected)


def engine_config(case, **overrides) -> EngineConfig:
    args = dict(
        model=str(case["model_dir"]),
        max_loras=2,
        max_lora_rank=16,
        max_num_seqs=8,
        block_size=8,
        max_model_len=128,
        dtype="float32",
    )
    return EngineConfig(**{**args, **overrides})


def make_engine(case, observer=None, **overrides) -> LLMEngine:
    engine = LLMEngine(engine_config(case, **overrides), skip_tokenizer_init=True, adapter_observer=observer)
    for name, path in case["adapters"].items():
        engine.register_adapter(name, str(path))
    return engine


def run_to_end(engine: LLMEngine, finals: dict | None = None) -> dict:
    finals = {} if finals is None else finals
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 21))] for _ in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["thread", "process"])
def test_eight_adapters_through_two_slots_match_peft(case, loader):
    """32 requests over 8 adapters arrive a few per step; only 2 GPU slots and 2 CPU images exist. With
    "process", every adapter is read in a loader process and crosses back through shared memory."""
    events = Counter()
    engine = make_engine(
        case, observer=lambda event, tier, seconds: events.update([(event, tier)]), adapter_loader=loader
    )
    rng = random.Random(7)
    assigned = [f"ad{i % 8}" for i in range(32)]
    rng.shuffle(assigned)
    all_prompts = prompts(1, 32)
    finals: dict = {}
    for start in range(0, 32, 4):  # arrivals interleave with steps, so the mix changes while running
        for i in range(start, start + 4):
            engine.add_request(str(i), all_prompts[i], GREEDY, assigned[i])
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    run_to_end(engine, finals)
    for i in range(32):
        assert finals[str(i)].error is None
        assert finals[str(i)].outputs[0].token_ids == case["expected"](all_prompts[i], assigned[i]), assigned[
            i
        ]
    assert engine.lora.allocator.num_evictions > 0
    assert events[("evict", "gpu")] == engine.lora.allocator.num_evictions
    assert events[("evict", "cpu")] > 0  # only two CPU images for eight adapters
    assert events[("hit", "gpu")] + events[("miss", "gpu")] == 32  # one lookup per request
    assert events[("load", "source")] >= 8 and events[("load", "cpu")] >= 8
    assert engine.stats().num_lora_slots_in_use == 0
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["thread", "process"])
def test_an_adapter_that_fails_to_load_fails_only_its_requests(case, tmp_path, loader):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(case["adapters"]["ad1"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    events = Counter()
    engine = make_engine(
        case, observer=lambda event, tier, seconds: events.update([(event, tier)]), adapter_loader=loader
    )
    plan = ["ad0", str(corrupt), "ad2", None, str(corrupt), "ad0", str(corrupt), "ad2"]
    all_prompts = prompts(2, len(plan))
    for i, (prompt, adapter) in enumerate(zip(all_prompts, plan)):
        engine.add_request(str(i), prompt, GREEDY, adapter)
    finals = run_to_end(engine)
    for i, adapter in enumerate(plan):
        output = finals[str(i)]
        if adapter == str(corrupt):
            assert output.outputs[0].finish_reason == "error"
            assert "not a valid safetensors file" in output.error and str(corrupt) in output.error
        else:
            assert output.error is None
            assert output.outputs[0].token_ids == case["expected"](all_prompts[i], adapter)
    assert events[("fail", "source")] == 1  # one load, shared by the adapter's three requests
    # Fails fast for a while (no reload per request), and the engine keeps serving the others.
    engine.add_request("again", all_prompts[0], GREEDY, str(corrupt))
    engine.add_request("fine", all_prompts[0], GREEDY, "ad0")
    finals = run_to_end(engine)
    assert "not a valid safetensors file" in finals["again"].error
    assert finals["fine"].outputs[0].token_ids == case["expected"](all_prompts[0], "ad0")
    engine.shutdown()


def test_version_swap_leaves_running_and_queued_requests_on_the_old_version(case):
    engine = make_engine(case, max_num_seqs=2)
    engine.register_adapter("bot", str(case["adapters"]["ad1"]))
    old_prompts, new_prompts = prompts(3, 3), prompts(4, 2)
    for i, prompt in enumerate(old_prompts):
        engine.add_request(f"old{i}", prompt, GREEDY, "bot")
    finals: dict = {}
    deadline = time.monotonic() + 60  # the first load may wait for loader processes to start
    while engine.scheduler.num_running < 2:
        assert time.monotonic() < deadline
        engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 1  # one still queued
    engine.register_adapter("bot", str(case["adapters"]["ad2"]))  # v2 ("bot~2") serves from now on
    for i, prompt in enumerate(new_prompts):
        engine.add_request(f"new{i}", prompt, GREEDY, "bot")
    run_to_end(engine, finals)
    for i, prompt in enumerate(old_prompts):
        assert finals[f"old{i}"].outputs[0].token_ids == case["expected"](prompt, "ad1")
    for i, prompt in enumerate(new_prompts):
        assert finals[f"new{i}"].outputs[0].token_ids == case["expected"](prompt, "ad2")
    # The old version is gone once its last request finished; the new one stays cached.
    assert engine.lora.allocator.lookup("bot") is None and "bot" not in engine.lora.cpu_ids()
    assert engine.lora.allocator.lookup("bot~2") is not None


def test_forget_adapter_refuses_new_requests_and_frees_the_slot_after_running_ones(case):
    engine = make_engine(case, max_num_seqs=2)
    running, queued = prompts(5, 2), prompts(6, 1)[0]
    for i, prompt in enumerate(running):
        engine.add_request(f"run{i}", prompt, GREEDY, "ad3")
    engine.add_request("queued", queued, GREEDY, "ad3")  # max_num_seqs 2: it waits
    while engine.scheduler.num_running < 2:
        engine.step()
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["run0", "run1"]
    engine.forget_adapter("ad3")
    engine.add_request("late", queued, GREEDY, "ad3")
    engine.add_request("other", queued, GREEDY, "ad4")
    assert engine.lora.allocator.lookup("ad3") is not None  # still pinned by the running two
    finals = run_to_end(engine)
    for i, prompt in enumerate(running):
        assert finals[f"run{i}"].outputs[0].token_ids == case["expected"](prompt, "ad3")
    assert finals["queued"].outputs[0].finish_reason == "error"
    assert "was deleted before this request started" in finals["queued"].error
    assert "'ad3' was deleted" in finals["late"].error
    assert finals["other"].outputs[0].token_ids == case["expected"](queued, "ad4")
    assert engine.lora.allocator.lookup("ad3") is None and "ad3" not in engine.lora.cpu_ids()
    assert engine.lora.num_slots_in_use == 0
    engine.forget_adapter("never-seen")  # harmless


def test_stats_reflect_running_waiting_and_adapters(case):
    engine = make_engine(case, max_num_seqs=2, max_loras=2)
    no_steps = HistogramCounts(ITERATION_TOKEN_BUCKETS, (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1), 0.0)
    idle = EngineStats(
        0,
        0,
        0.0,
        0,
        0,
        0,
        (),
        (),
        2,
        0,
        0,
        cache_config=engine.stats().cache_config,
        iteration_tokens=no_steps,
    )
    assert engine.stats() == idle
    assert dict(idle.cache_config)["block_size"] == str(engine.config.block_size)
    plan = [("a", "ad5"), ("b", None), ("c", "ad6"), ("d", "ad5")]
    all_prompts = prompts(8, len(plan))
    for (request_id, adapter), prompt in zip(plan, all_prompts):
        engine.add_request(request_id, prompt, GREEDY, adapter)
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_adapters_loading) == (4, 2)
    assert stats.waiting_adapters == ("ad5", "ad6") and stats.running_adapters == ()
    while engine.lora.num_loading:  # both loads land before the first step
        engine.lora.wait_for_loads(1.0)
        assert engine.lora.poll() == {}
    engine.step()
    for _ in range(3):  # on CUDA the slot copy is issued after the first step's launch: "a" joins later
        if engine.scheduler.num_running == 2:
            break
        engine.step()
    stats = engine.stats()
    assert sorted(r.request_id for r in engine.scheduler.running) == ["a", "b"]
    assert stats.running_adapters == ("ad5",) and stats.waiting_adapters == ("ad5", "ad6")
    assert stats.num_lora_slots_in_use == 1 and 0.0 < stats.kv_cache_usage <= 1.0
    assert stats.num_adapters_loading == 0
    finals = run_to_end(engine)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_generation_tokens == sum(len(f.outputs[0].token_ids) for f in finals.values()) == 32
    assert stats.num_prompt_tokens == sum(len(p) for p in all_prompts)


@pytest.mark.slow
def test_async_forget_and_stats_through_the_engine_core_process(case):
    modules = {name: str(path) for name, path in case["adapters"].items()}
    llm = AsyncLLM.from_config(engine_config(case), skip_tokenizer_init=True, lora_modules=modules)
    prompt = prompts(9, 1)[0]

    async def scenario():
        stream = llm.generate(prompt, LONG, "long", "ad7")
        first = await anext(stream)  # the request runs
        stats = await _wait_for(llm, lambda s: s.running_adapters == ("ad7",))
        assert stats.num_running == 1 and stats.num_lora_slots_in_use == 1
        llm.forget_adapter("ad7")
        refused = [o async for o in llm.generate(prompt, GREEDY, "late", "ad7")]
        rest = [o async for o in stream]
        idle = await _wait_for(llm, lambda s: s.num_running == 0)
        return first, refused, rest, idle

    try:
        first, refused, rest, idle = asyncio.run(scenario())
    finally:
        llm.shutdown()
    assert "'ad7' was deleted" in refused[-1].error
    tokens = first.outputs[0].token_ids + sum((o.outputs[0].token_ids for o in rest), [])
    assert rest[-1].error is None and tokens == case["expected"](prompt, "ad7", 40)
    assert idle.num_lora_slots_in_use == 0 and idle.num_generation_tokens == 40
    assert idle.running_adapters == idle.waiting_adapters == ()


async def _wait_for(llm: AsyncLLM, condition, timeout: float = 10.0) -> EngineStats:
    deadline = time.monotonic() + timeout
    while not condition(stats := llm.stats()):
        assert time.monotonic() < deadline, f"stats never matched: {stats}"
        await asyncio.sleep(0.005)
    return stats


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_a_staged_copy_lands_in_its_slot_and_is_timed(case, device):
    """The copy is issued by start_copies (after the step's launch), on CUDA on a side stream; is_ready
    turns true only once it completed."""
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(case["model_dir"]))
    slots = LoRAPool(shape, max_loras=2, max_rank=16, dtype=torch.bfloat16, device=torch.device(device))
    registry = AdapterRegistry(shape, 16)
    registry.register("x", case["adapters"]["ad3"])
    events = []
    manager = AdapterManager(registry, slots, max_cpu_loras=2, observer=lambda *event: events.append(event))
    manager.prefetch("x")
    while manager.num_loading:
        manager.wait_for_loads(timeout=1.0)
        assert manager.poll() == {}
    manager.stage(["x"])
    if device == "cuda":
        assert not manager.is_ready("x")  # a slot is chosen; the copy waits for the step's launch
    manager.start_copies()
    deadline = time.monotonic() + 10
    while not manager.is_ready("x"):
        assert time.monotonic() < deadline
    slot = manager.acquire("x")
    image, held = slots.image(registry.load("x")), slots.snapshot(slot)
    for module in TARGET_MODULES:
        assert torch.equal(held.lora_a[module], image.lora_a[module])
        assert torch.equal(held.lora_b[module], image.lora_b[module])
        assert torch.equal(slots.scales[module][:, slot].cpu(), image.scales[module])
    kinds = [(event, tier) for event, tier, _ in events]
    assert kinds == [("miss", "gpu"), ("miss", "cpu"), ("load", "source"), ("load", "cpu")]
    assert all(seconds > 0 for event, _, seconds in events if event == "load")
    manager.release("x")
    manager.forget("x")  # nobody holds it: dropped at once
    assert manager.allocator.lookup("x") is None and not manager.is_ready("x")
    manager.shutdown()


def test_a_row_of_the_cpu_tier_is_not_reused_while_a_dropped_load_still_writes_it(case):
    """One row: an adapter deleted mid-load keeps its row until the load ends; only then does the next
    adapter load into it, and what lands in the slot is the next adapter's."""
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(case["model_dir"]))
    slots = LoRAPool(shape, max_loras=1, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    gate = threading.Event()

    class GatedRegistry(AdapterRegistry):
        def load(self, adapter_id, read=None):
            if adapter_id == "slow":
                assert gate.wait(10)
            return super().load(adapter_id, read)

    registry = GatedRegistry(shape, 16)
    registry.register("slow", case["adapters"]["ad1"])
    registry.register("next", case["adapters"]["ad2"])
    manager = AdapterManager(registry, slots, max_cpu_loras=1)
    manager.prefetch("slow")
    manager.forget("slow")  # nobody holds it; its load is already running
    manager.prefetch("next")
    manager.stage(["next"])
    assert manager.num_loading == 1 and manager.poll() == {}  # "next" waits: the only row is being written
    gate.set()
    deadline = time.monotonic() + 10
    while not manager.is_ready("next"):
        assert time.monotonic() < deadline
        manager.wait_for_loads(timeout=0.1)
        assert manager.poll() == {}
        manager.stage(["next"])
        manager.start_copies()
    slot = manager.acquire("next")
    expected, held = slots.image(registry.load("next")), slots.snapshot(slot)
    for module in TARGET_MODULES:
        assert torch.equal(held.lora_a[module], expected.lora_a[module])
        assert torch.equal(held.lora_b[module], expected.lora_b[module])
    assert not manager.is_ready("slow") and "slow" not in manager.cpu_ids()
    manager.shutdown()


class _FakeEvent:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return 1.0


class _FakeStream:
    def wait_stream(self, stream) -> None:
        pass


def test_a_copy_is_decided_by_stage_and_issued_by_start_copies_in_order(case, monkeypatch):
    """The CUDA path without a GPU: `stage` only picks the slot (nothing is copied, the adapter is not
    ready, its row may not be rewritten); `start_copies` issues the copies in the order they were staged,
    and an adapter evicted before its copy was issued never reads as ready."""
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(case["model_dir"]))
    slots = LoRAPool(shape, max_loras=1, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    registry = AdapterRegistry(shape, 16)
    registry.register("a", case["adapters"]["ad1"])
    registry.register("b", case["adapters"]["ad2"])
    manager = AdapterManager(registry, slots, max_cpu_loras=2)
    for adapter_id in ("a", "b"):
        manager.prefetch(adapter_id)
    while manager.num_loading:
        manager.wait_for_loads(timeout=1.0)
        assert manager.poll() == {}
    issued: list[tuple[int, int, _FakeEvent]] = []

    def copy_into(slot, row):
        issued.append((slot, row, _FakeEvent()))
        return _FakeEvent(), issued[-1][2]

    monkeypatch.setattr(manager, "_copy_stream", _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(manager, "_copy_into", copy_into)
    row_a, row_b = manager._records["a"].row, manager._records["b"].row

    manager.stage(["a"])
    assert issued == [] and not manager.is_ready("a") and not manager._row_writable(row_a)
    manager.start_copies()
    assert [(slot, row) for slot, row, _ in issued] == [(0, row_a)]
    assert not manager.is_ready("a") and not manager._row_writable(row_a)  # the copy is still in flight
    issued[0][2].done = True
    assert manager.is_ready("a") and manager._row_writable(row_a)

    manager.stage(["b"])  # evicts "a" (unpinned) from the only slot
    manager.stage(["a"])  # and "a" evicts "b" before either copy was issued
    assert not manager.is_ready("a") and not manager.is_ready("b")
    manager.start_copies()
    assert [(slot, row) for slot, row, _ in issued[1:]] == [(0, row_b), (0, row_a)]
    issued[1][2].done = True  # "b" landed, but "a" was copied over it afterwards
    assert not manager.is_ready("b") and not manager.is_ready("a")
    issued[2][2].done = True
    assert manager.is_ready("a") and not manager.is_ready("b")
    manager.shutdown()
