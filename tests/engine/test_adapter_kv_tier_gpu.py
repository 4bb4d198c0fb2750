"""The KV tier on CUDA, where saves and restores run on the copy stream and requests' K/V on the compute
stream: adapters cycling through few slots come back from KV blocks with the same greedy tokens as an
engine without the tier; under KV pressure (concurrent long prompts taking the cached adapters' blocks
while copies may be in flight) the tokens stay the same; a restore is bit for bit."""

from __future__ import annotations

import pytest
import torch
from factories import C1_ADAPTERS, make_adapter, make_model

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora.residency import AdapterStatus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
NAMES = [f"ad{i}" for i in range(6)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-tier-gpu")
    model_dir = make_model(root / "model", seed=13)
    configs = list(C1_ADAPTERS.values())
    adapters = {
        name: make_adapter(model_dir, root / name, seed=700 + i, **configs[i % len(configs)])
        for i, name in enumerate(NAMES)
    }
    return model_dir, adapters


def make_engine(case, kv_tier: bool, num_kv_blocks: int = 256) -> tuple[LLMEngine, list]:
    model_dir, adapters = case
    events: list = []
    config = EngineConfig(
        model=str(model_dir),
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=16,
        block_size=16,
        max_model_len=256,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=16,
        dtype="float32",
        device="cuda",
        enable_adapter_kv_cache=kv_tier,
    )
    engine = LLMEngine(
        config, skip_tokenizer_init=True, adapter_observer=lambda e, t, s=0.0: events.append((e, t))
    )
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    return engine, events


def run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]]) -> dict[str, list[int]]:
    for request_id, prompt, adapter in requests:
        engine.add_request(request_id, prompt, GREEDY, adapter)
    tokens = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return tokens
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    raise AssertionError("the requests did not finish")


def workload(round_: int) -> list[tuple[str, list[int], str | None]]:
    """Two adapters at a time through two slots, in waves, plus long base-model prompts that press on KV."""
    requests = []
    for wave in range(3):
        for i, name in enumerate(NAMES):
            prompt = [3 + (i * 7 + wave) % 50, 14, 15, 92, 65, 35 + wave]
            requests.append((f"r{round_}-{wave}-{name}", prompt, name))
        long = [(5 + round_ + wave + k) % 500 for k in range(200)]
        requests.append((f"r{round_}-{wave}-long", long, None))
    return requests


@pytest.mark.parametrize(
    "num_kv_blocks", [256, 48]
)  # room to spare; pressure (48 blocks, 14 per long prompt)
def test_tokens_match_an_engine_without_the_tier(case, num_kv_blocks):
    def drive(engine: LLMEngine) -> dict[str, list[int]]:
        """The same schedule on both engines (batches change float sums): each round's first wave of
        adapter requests together, then one request at a time."""
        tokens = {}
        for round_ in range(2):
            requests = workload(round_)
            tokens.update(run(engine, requests[: len(NAMES)]))
            for request in requests[len(NAMES) :]:
                tokens.update(run(engine, [request]))
        return tokens

    reference_engine, _ = make_engine(case, kv_tier=False, num_kv_blocks=num_kv_blocks)
    try:
        expected = drive(reference_engine)
    finally:
        reference_engine.shutdown()
    engine, events = make_engine(case, kv_tier=True, num_kv_blocks=num_kv_blocks)
    try:
        assert drive(engine) == expected
        assert ("hit", "kv") in events
        if num_kv_blocks == 48:
            assert ("evict", "kv") in events  # requests took cached adapters' blocks
    finally:
        engine.shutdown()


def test_a_restore_on_the_copy_stream_is_bit_identical(case):
    engine, events = make_engine(case, kv_tier=True)
    lora = engine.lora
    try:
        run(engine, [("a", [3, 4, 5], "ad0")])
        before = lora.slots.snapshot(lora.allocator.lookup("ad0"))
        run(engine, [("b", [3, 4, 5], "ad1"), ("c", [3, 4, 5], "ad2")])  # two slots: ad0 goes to KV blocks
        assert lora.status("ad0") is AdapterStatus.KV
        lora.place("ad0", pin=False)
        for _ in range(200):
            engine.advance_adapters()
            if lora.is_ready("ad0"):
                break
        assert lora.is_ready("ad0") and ("load", "kv") in events
        after = lora.slots.snapshot(lora.allocator.lookup("ad0"))
        assert torch.equal(before.weights.view(torch.int32), after.weights.view(torch.int32))
        assert torch.equal(before.table, after.table)
    finally:
        engine.shutdown()


def test_the_whole_budget_gives_the_kv_cache_the_blocks_no_request_can_use(case):
    model_dir, _ = case
    common = dict(max_num_seqs=4, max_model_len=64, block_size=16, gpu_memory_utilization=0.05, device="cuda")
    capped = LLMEngine(EngineConfig(model=str(model_dir), **common), skip_tokenizer_init=True)
    num_capped = capped.runner.num_kv_blocks
    capped.shutdown()
    whole = LLMEngine(
        EngineConfig(model=str(model_dir), kv_cache_whole_budget=True, **common), skip_tokenizer_init=True
    )
    try:
        assert num_capped == 4 * 64 // 16  # what 4 sequences of 64 tokens can use
        assert whole.runner.num_kv_blocks > 100 * num_capped
    finally:
        whole.shutdown()
