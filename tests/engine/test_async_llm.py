"""The streaming API: deltas add up to the offline result, abort frees the request's KV blocks."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engines(text_model_dir, text_adapters):
    def build():
        return LLM(
            model=str(text_model_dir),
            lora_modules={k: str(v) for k, v in text_adapters.items()},
            max_loras=2,
            max_lora_rank=8,
            max_model_len=96,
            block_size=4,
        ).engine

    offline = build()
    streaming = AsyncLLM(build())
    yield offline, streaming
    streaming.shutdown()


async def _collect(llm: AsyncLLM, prompt, params, request_id, adapter=None):
    deltas = [d async for d in llm.generate(prompt, params, request_id, adapter)]
    return deltas


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
    engine = streaming.engine

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        stream = streaming.generate("The quick brown fox", params, "leaver")
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        for _ in range(100):  # the abort is applied by the engine thread
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage == 0.0
    assert engine.kv_cache.get_block_ids("leaver") == []


def test_failed_request_reports_its_error(engines):
    _, streaming = engines
    deltas = asyncio.run(_collect(streaming, "hi", SamplingParams(max_tokens=2), "bad", "missing"))
    assert len(deltas) == 1 and deltas[0].finished
    assert "unknown adapter 'missing'" in deltas[0].error


def test_a_request_that_breaks_its_step_fails_alone_and_streams_go_on(engines, monkeypatch):
    """The engine loop survives a request whose data raises inside the step (a fault injected into its
    sampling at its third token): its stream ends with an error, the others finish, the engine serves on."""
    offline, streaming = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in _offline(offline, ["Hello world", "The end."], greedy)]
    sampler = streaming.engine.sampler
    real = sampler._request_generator

    def faulty(request, device):
        if request.sampling_params.seed == 666 and request.num_output_tokens == 2:
            raise RuntimeError("Overflow when unpacking long long")
        return real(request, device)

    monkeypatch.setattr(sampler, "_request_generator", faulty)
    poisoned = SamplingParams(temperature=1.0, seed=666, max_tokens=8, ignore_eos=True)

    async def main():
        streams = asyncio.gather(
            _collect(streaming, "Hello world", greedy, "good-1"),
            _collect(streaming, "hi", poisoned, "poisoned", "alpha"),
            _collect(streaming, "The end.", greedy, "good-2"),
        )
        return await asyncio.wait_for(streams, timeout=60)

    good_1, bad, good_2 = asyncio.run(main())
    streamed = [[t for d in deltas for t in d.outputs[0].token_ids] for deltas in (good_1, good_2)]
    assert streamed == expected
    assert bad[-1].finished and bad[-1].outputs[0].finish_reason == "error" and bad[-1].error
    assert [t for d in bad for t in d.outputs[0].token_ids][:2] and streaming.dead_error is None
    after = asyncio.run(_collect(streaming, "The end.", greedy, "after"))
    assert [t for d in after for t in d.outputs[0].token_ids] == expected[1]


def _offline(engine, prompts, params):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"offline-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done[f"offline-{i}"] for i in range(len(prompts))]
