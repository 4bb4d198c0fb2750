"""The streaming API (engine core in its own process): deltas add up to the offline result, abort frees
the request's KV blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, EngineConfig, SamplingParams

ENGINE_ARGS = dict(max_loras=2, max_lora_rank=8, max_model_len=96, block_size=4)


@pytest.fixture(scope="module")
def engines(text_model_dir, text_adapters):
    modules = {k: str(v) for k, v in text_adapters.items()}
    offline = LLM(model=str(text_model_dir), lora_modules=modules, **ENGINE_ARGS).engine
    config = EngineConfig(model=str(text_model_dir), **ENGINE_ARGS)
    streaming = AsyncLLM.from_config(config, lora_modules=modules, startup_timeout_s=120)
    try:
        yield offline, streaming
    finally:
        streaming.shutdown()


async def _collect(llm: AsyncLLM, prompt, params, request_id, adapter=None):
    deltas = [d async for d in llm.generate(prompt, params, request_id, adapter)]
    return deltas


@pytest.mark.slow
def test_deltas_concatenate_to_the_offline_output(engines):
    offline, streaming = engines
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    offline.add_request("ref", "Hello world", params, "alpha")
    expected = None
    while offline.has_unfinished_requests():
        for out in offline.step():
            expected = out

    async def run():
        return await asyncio.gather(
            _collect(streaming, "Hello world", params, "a", "alpha"),
            _collect(streaming, "你好世界", params, "b", "beta"),
        )

    deltas, _ = asyncio.run(run())
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == expected.outputs[0].text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == expected.outputs[0].token_ids
    assert len(sum((d.outputs[0].logprobs for d in deltas), [])) == 10
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_consumer_leaving_aborts_and_frees_blocks(engines):
    _, streaming = engines

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        stream = streaming.generate("The quick brown fox", params, "leaver")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        for _ in range(200):  # the core applies the abort, then publishes its stats
            stats = streaming.stats()
            if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.01)
        return stats

    stats = asyncio.run(run())
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.num_generation_tokens < 80  # stopped early, not run to max_tokens


def test_failed_request_reports_its_error(engines):
    _, streaming = engines
    deltas = asyncio.run(_collect(streaming, "hi", SamplingParams(max_tokens=2), "bad", "missing"))
    assert len(deltas) == 1 and deltas[0].finished
    assert "unknown adapter 'missing'" in deltas[0].error
