"""The KV tier: adapters that lose their GPU slot keep a copy in idle KV blocks (engine/lora/kv_tier.py).

With KV to spare, adapters cycling through one slot come back from the KV tier (a copy on the device,
bit for bit, no second load from the source); under KV pressure the cached copies give their blocks to
requests at once, and every request still produces transformers + PEFT's tokens; a replaced or deleted
version loses its copy; the lookups, loads and held blocks are counted."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from factories import load_peft_reference, make_adapter, make_model, reference_greedy

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache.block_pool import BlockPool
from engine.lora.kv_tier import AdapterKVTier, staging_words
from engine.lora.pool import LoRAPool
from engine.lora.registry import AdapterRegistry
from engine.lora.residency import AdapterStatus

NUM_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
PROMPT = [5, 6, 7, 8, 9, 10]
NAMES = ("one", "two", "three")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-tier")
    model_dir = make_model(root / "model", seed=11)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=60 + i, r=8, target_modules="all-linear")
        for i, name in enumerate(NAMES)
    }
    return model_dir, adapters


@pytest.fixture(scope="module")
def reference(folders):
    model_dir, adapters = folders
    return load_peft_reference(model_dir, adapters)


class CountingRegistry(AdapterRegistry):
    def __init__(self, shape, max_lora_rank):
        super().__init__(shape, max_lora_rank)
        self.loads: dict[str, int] = {}
        self.lock = threading.Lock()

    def load(self, adapter_id, read=None):
        with self.lock:
            self.loads[adapter_id] = self.loads.get(adapter_id, 0) + 1
        return super().load(adapter_id, read)


def make_engine(folders, **overrides):
    """One slot and one CPU-tier row, 16-token blocks of 8 KiB: an adapter of the tiny model (one 64 KiB
    page) takes 8 blocks."""
    model_dir, adapters = folders
    made: list[CountingRegistry] = []
    events: list[tuple[str, str]] = []

    def factory(shape, max_lora_rank):
        registry = CountingRegistry(shape, max_lora_rank)
        for name, path in adapters.items():
            registry.register(name, path)
        made.append(registry)
        return registry

    args = dict(model=str(model_dir), max_loras=1, max_cpu_loras=1, max_lora_rank=8, max_num_seqs=4)
    args.update(block_size=16, max_model_len=128, num_kv_blocks=48, dtype="float32", adapter_loader="thread")
    args.update(enable_adapter_kv_cache=True)  # off by default
    engine = LLMEngine(
        EngineConfig(**{**args, **overrides}),
        skip_tokenizer_init=True,
        adapter_source_factory=factory,
        adapter_observer=lambda event, tier, seconds: events.append((event, tier)),
    )
    return engine, made[0], events


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    """Run requests {id: (prompt, adapter)} together; their tokens by id."""
    for request_id, (prompt, adapter) in requests.items():
        engine.add_request(request_id, prompt, GREEDY, adapter=adapter)
    tokens: dict[str, list[int]] = {}
    for _ in range(300):
        if not engine.has_unfinished_requests():
            return tokens
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    raise AssertionError("the requests did not finish in 300 steps")


def count(events, event: str, tier: str) -> int:
    return sum(1 for e in events if e == (event, tier))


def test_adapters_cycling_through_one_slot_come_back_from_the_kv_tier(folders, reference):
    engine, registry, events = make_engine(folders)
    lora = engine.lora
    try:
        for round_ in range(2):
            for name in NAMES:
                got = run(engine, {f"{name}-{round_}": (PROMPT, name)})[f"{name}-{round_}"]
                assert got == reference_greedy(reference, PROMPT, name, NUM_TOKENS), name
        # each loaded once from the source; the second round's came back from KV blocks, not the source
        assert registry.loads == dict.fromkeys(NAMES, 1)
        assert count(events, "hit", "kv") == 3
        assert count(events, "load", "kv") == 3
        assert count(events, "miss", "kv") == 3  # the first round's
        assert count(events, "hit", "cpu") == 0  # the row held another adapter each time
        # two adapters wait in KV blocks, one is in the slot (its copy kept too: its next eviction is free)
        assert sorted(lora.status(n).value for n in NAMES) == ["kv", "kv", "resident"]
        stats = engine.stats()
        assert stats.num_kv_adapter_blocks == lora.kv.num_blocks == 3 * 8
        assert stats.num_kv_adapters == 3
        assert stats.kv_cache_usage == 0.0  # lent blocks are free blocks
        cold = {tier: sum(h.counts) for tier, h in stats.adapter_cold_start}
        assert cold.get("kv") == 3
    finally:
        engine.shutdown()


def test_a_restored_adapter_is_bit_identical(folders):
    engine, _, events = make_engine(folders)
    lora = engine.lora
    try:
        run(engine, {"a": (PROMPT, "one")})
        before = lora.slots.snapshot(lora.allocator.lookup("one"))
        run(engine, {"b": (PROMPT, "two")})
        assert lora.status("one") is AdapterStatus.KV and lora.cpu_ids() == ("two",)
        # the slot and its page now hold "two": the copy can only come from the KV blocks
        lora.place("one", pin=False)
        lora.stage(())
        assert lora.is_ready("one") and count(events, "load", "kv") == 1
        after = lora.slots.snapshot(lora.allocator.lookup("one"))
        assert torch.equal(before.weights.view(torch.int32), after.weights.view(torch.int32))
        assert torch.equal(before.table, after.table)
    finally:
        engine.shutdown()


def test_copies_in_non_contiguous_pages_round_trip_bit_for_bit(folders):
    """The tier's save and restore over pages that are not one run, into other pages, on random bytes."""
    engine, _, _ = make_engine(folders, enable_adapter_kv_cache=False)
    shape = engine.runner.shape
    engine.shutdown()
    pool = LoRAPool(shape, max_loras=2, max_rank=32, dtype=torch.float32, device=torch.device("cpu"))
    storage = torch.zeros(4, 64, 16, 2, 16)  # [2 * layers, blocks, block_size, kv heads, head dim]
    word, words = staging_words(pool, storage[:, 0].numel() * 4, storage.shape[0])
    tier = AdapterKVTier(BlockPool(63, True), storage, torch.empty(words, dtype=word), pool, lambda *a: None)
    pool.weights.copy_(torch.randn_like(pool.weights))
    pool.table[:, :, 0] = torch.randint(1, 9, pool.table[:, :, 0].shape, dtype=torch.int32)
    saved = pool.weights[[6, 2, 3]].clone()
    assert tier.save("t/a@1", 0, [6, 2, 3])
    table = pool.table[:, :, 0].clone()
    pool.weights.zero_()
    pool.table.zero_()
    tier.restore("t/a@1", 1, [1, 0, 7, 5])
    assert torch.equal(pool.weights[[1, 0, 7]].view(torch.int32), saved.view(torch.int32))
    assert torch.equal(pool.table[:, :, 1], table)
    assert pool.page_table[1, :3].tolist() == [1, 0, 7]
    assert tier.num_blocks == tier.blocks_for(3)


def test_under_kv_pressure_cached_adapters_give_their_blocks_to_requests(folders, reference):
    # 24 blocks: two cached adapters hold 16; three requests of 100 tokens need 7 blocks each
    engine, registry, events = make_engine(folders, num_kv_blocks=24)
    lora, pool = engine.lora, engine.kv_cache.block_pool
    try:
        run(engine, {"a": (PROMPT, "one")})
        run(engine, {"b": (PROMPT, "two")})
        run(engine, {"c": (PROMPT, "three")})
        assert lora.kv.num_blocks == 16 and count(events, "evict", "kv") == 0
        long = [list(range(3 + i, 103 + i)) for i in range(3)]
        got = run(engine, {f"long{i}": (prompt, None) for i, prompt in enumerate(long)})
        for i, prompt in enumerate(long):
            assert got[f"long{i}"] == reference_greedy(reference, prompt, None, NUM_TOKENS)
        assert engine.scheduler.num_preemptions == 0  # nothing waited for the cached adapters' blocks
        assert count(events, "evict", "kv") >= 1
        lost = [n for n in ("one", "two") if lora.status(n) is not AdapterStatus.KV]
        assert lost and lora.kv.num_blocks == 8 * (2 - len(lost))
        assert pool.num_lent_blocks == lora.kv.num_blocks
        # a lost adapter comes back from the source, with the right tokens
        got = run(engine, {"again": (PROMPT, lost[0])})["again"]
        assert got == reference_greedy(reference, PROMPT, lost[0], NUM_TOKENS)
        assert registry.loads[lost[0]] == 2
    finally:
        engine.shutdown()


def test_a_replaced_or_deleted_version_loses_its_cached_copy(folders, tmp_path):
    model_dir, adapters = folders
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            max_loras=1,
            max_cpu_loras=1,
            max_lora_rank=8,
            block_size=16,
            max_model_len=128,
            num_kv_blocks=48,
            dtype="float32",
            adapter_loader="thread",
            enable_adapter_kv_cache=True,
        ),
        skip_tokenizer_init=True,
    )
    lora = engine.lora
    try:
        engine.register_adapter("one", str(adapters["one"]))
        engine.register_adapter("two", str(adapters["two"]))
        old_one = lora.resolve("one")
        run(engine, {"a": (PROMPT, "one")})
        run(engine, {"b": (PROMPT, "two")})
        assert lora.kv.has(old_one)
        engine.register_adapter("one", str(adapters["three"]))  # a new version replaces it
        assert not lora.kv.has(old_one) and lora.resolve("one") != old_one
        run(engine, {"c": (PROMPT, "one")})  # the new version; "two" goes to KV blocks
        two = lora.resolve("two")
        assert lora.kv.has(two)
        engine.forget_adapter(two)
        assert not lora.kv.has(two) and lora.status(two) is AdapterStatus.DELETED
        assert engine.kv_cache.block_pool.num_lent_blocks == lora.kv.num_blocks
    finally:
        engine.shutdown()


def test_off_by_default_and_when_the_setting_says_so(folders):
    assert EngineConfig(model=str(folders[0])).enable_adapter_kv_cache is False
    engine, registry, events = make_engine(folders, enable_adapter_kv_cache=False)
    try:
        for name in (*NAMES, "one"):
            run(engine, {name + "x": (PROMPT, name)})
        assert engine.lora.kv is None and engine.runner.kv_tier_staging is None
        assert registry.loads["one"] == 2  # dropped by the CPU tier's LRU, loaded again
        assert not [e for e in events if e[1] == "kv"]
        assert engine.stats().num_kv_adapter_blocks == 0
    finally:
        engine.shutdown()


def test_a_cold_start_whose_kv_copy_is_reclaimed_counts_where_it_came_from(folders, reference):
    """A request for an adapter in KV blocks waits (the one slot is busy) while requests take the
    blocks: the adapter comes from its CPU-tier row instead, and its cold start is counted there."""
    engine, registry, events = make_engine(folders, num_kv_blocks=24, max_cpu_loras=2)
    lora = engine.lora
    try:
        run(engine, {"a": (PROMPT, "one")})
        run(engine, {"b": (PROMPT, "two")})  # "one" to KV blocks, its CPU-tier row kept
        assert lora.status("one") is AdapterStatus.KV and lora.cpu_ids() == ("one", "two")
        engine.add_request(
            "busy", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40), "two"
        )
        long = [list(range(3 + i, 103 + i)) for i in range(2)]
        got = run(engine, {"again": (PROMPT, "one"), **{f"long{i}": (p, None) for i, p in enumerate(long)}})
        assert count(events, "hit", "kv") == 1 and count(events, "evict", "kv") == 1
        assert count(events, "load", "kv") == 0 and registry.loads["one"] == 1
        assert got["again"] == reference_greedy(reference, PROMPT, "one", NUM_TOKENS)
        cold = {tier: sum(h.counts) for tier, h in engine.stats().adapter_cold_start}
        assert cold == {"disk": 2, "cpu": 1}  # the last from its row, not from KV blocks
    finally:
        engine.shutdown()


def test_shutdown_frees_the_kv_cache_the_tier_saw(folders):
    """The block pool's hooks reach the tier, which holds a view of the KV cache and the staging buffer:
    shutdown lets go of them, so they free at once although the caller keeps the engine."""
    engine, _, _ = make_engine(folders)
    run(engine, {"a": (PROMPT, "one")})
    run(engine, {"b": (PROMPT, "two")})
    assert engine.lora.kv.num_adapters == 1
    freed = [weakref.ref(engine.runner.kv_storage), weakref.ref(engine.runner.kv_tier_staging)]
    block_pool = weakref.ref(engine.kv_cache.block_pool)
    engine.shutdown()
    gc.collect()
    assert [ref() for ref in freed] == [None, None] and block_pool() is None


def test_a_failure_while_taking_a_slot_leaves_the_held_blocks_free(folders, monkeypatch):
    engine, _, _ = make_engine(folders)
    lora, blocks = engine.lora, engine.kv_cache.block_pool
    try:
        run(engine, {"a": (PROMPT, "one")})
        run(engine, {"b": (PROMPT, "two")})
        one = lora.resolve("one")
        assert lora.kv.has(one) and blocks.num_free_blocks == 48

        def broken(*args):
            raise RuntimeError("boom")

        monkeypatch.setattr(lora, "_take_slot", broken)
        with pytest.raises(RuntimeError, match="boom"):
            lora.stage([one])  # holds one's blocks, then fails
        assert blocks.num_free_blocks == 48 and blocks.num_lent_blocks == 8 and lora.kv.has(one)
    finally:
        engine.shutdown()
