"""Operator placements on CUDA, where a slot's copy runs on a side stream: an idle engine issues the copy,
sees it complete and pins the slot; the pinned adapter survives every other adapter's requests and serves
the same greedy tokens as without the pin."""

from __future__ import annotations

import time

import pytest
import torch
from factories import C1_ADAPTERS, make_adapter, make_model

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.lora.residency import AdapterStatus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("placements-gpu")
    model_dir = make_model(root / "model", seed=9)
    configs = list(C1_ADAPTERS.values())
    adapters = {
        f"ad{i}": make_adapter(model_dir, root / f"ad{i}", seed=500 + i, **configs[i % len(configs)])
        for i in range(5)
    }
    return model_dir, adapters


def make_engine(case) -> LLMEngine:
    model_dir, adapters = case
    config = EngineConfig(
        model=str(model_dir), max_loras=3, max_lora_rank=16, block_size=16, max_model_len=128, device="cuda"
    )
    engine = LLMEngine(config, skip_tokenizer_init=True)
    for name, path in adapters.items():
        engine.register_adapter(name, str(path))
    return engine


def run(engine: LLMEngine, adapters: list[str]) -> dict[str, list[int]]:
    for adapter in adapters:
        engine.add_request(f"r-{adapter}-{time.monotonic_ns()}", PROMPT, GREEDY, adapter)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                tokens[output.adapter] = output.outputs[0].token_ids
    return tokens


def test_a_pin_lands_while_idle_and_holds_on_cuda(case):
    plain = make_engine(case)
    try:
        expected = run(plain, ["ad0"])["ad0"]
    finally:
        plain.shutdown()
    engine = make_engine(case)
    try:
        engine.preload_adapters(["ad0"], level="gpu", pin=True)
        deadline = time.monotonic() + 60
        while engine.lora.status("ad0") is not AdapterStatus.PINNED:  # the core's idle loop, by hand
            assert time.monotonic() < deadline, engine.stats().lora_residency
            engine.advance_adapters()
            time.sleep(0.01)
        for batch in (["ad1", "ad2"], ["ad3", "ad4"], ["ad1", "ad3", "ad0"]):
            tokens = run(engine, batch)
            assert engine.lora.status("ad0") is AdapterStatus.PINNED
        assert tokens["ad0"] == expected
        engine.unpin_adapters(["ad0"], unload=True)
        assert engine.lora.status("ad0") is None
    finally:
        engine.shutdown()
