"""The engine core in its own process: same tokens as the in-process engine under concurrent streams,
a stop string found in the front end frees the request in the core, a killed core fails every stream at
once, and no core outlives its front end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from processes import alive, child_pids, kill_quietly, wait_gone

from engine import LLM, AsyncLLM, EngineConfig, EngineDeadError, EngineStartupError, SamplingParams

ENGINE_ARGS = dict(max_loras=2, max_lora_rank=8, max_model_len=96, block_size=4, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def start_core(model_dir: Path, adapters: dict[str, Path] | None = None) -> AsyncLLM:
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    modules = {k: str(v) for k, v in (adapters or {}).items()}
    return AsyncLLM.from_config(config, lora_modules=modules, startup_timeout_s=120)


@pytest.fixture(scope="module")
def offline(text_model_dir, text_adapters):
    modules = {k: str(v) for k, v in text_adapters.items()}
    return LLM(model=str(text_model_dir), lora_modules=modules, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def served(text_model_dir, text_adapters):
    """One core process for the tests that leave it serving."""
    llm = start_core(text_model_dir, text_adapters)
    pid = llm.core_pid
    try:
        yield llm
    finally:
        llm.shutdown()
        kill_quietly(pid)


async def collect(llm: AsyncLLM, prompt, params, request_id, adapter=None):
    return [d async for d in llm.generate(prompt, params, request_id, adapter)]


def joined(deltas, index: int = 0) -> tuple[list[int], str]:
    completions = [c for d in deltas for c in d.outputs if c.index == index]
    return sum((c.token_ids for c in completions), []), "".join(c.text for c in completions)


@pytest.mark.slow
def test_concurrent_streams_match_the_in_process_engine(served, offline):
    prompts = ["Hello world", "你好世界", "The quick brown fox", "a", "Once upon", "zzz"]
    adapters = ["alpha", "beta", None, "alpha", None, "beta"]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=2, ignore_eos=True, logprobs=1)
    expected = offline.generate(prompts, GREEDY, adapters=adapters)
    expected_sampled = offline.generate(["Hello world"], sampled)[0]

    async def run():
        greedy = [collect(served, p, GREEDY, f"g{i}", a) for i, (p, a) in enumerate(zip(prompts, adapters))]
        return await asyncio.gather(collect(served, "Hello world", sampled, "s"), *greedy)

    sampled_deltas, *results = asyncio.run(run())
    for deltas, reference in zip(results, expected):
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        assert joined(deltas) == (reference.outputs[0].token_ids, reference.outputs[0].text)
    for index in (0, 1):  # n = 2 fans out into two seeded core requests and back in
        reference = expected_sampled.outputs[index]
        assert joined(sampled_deltas, index) == (reference.token_ids, reference.text)
        logprobs = sum((c.logprobs for d in sampled_deltas for c in d.outputs if c.index == index), [])
        assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in reference.logprobs]
        # Other batch shapes than offline: float32 rounding differs a little.
        assert [lp.logprob for lp in logprobs] == pytest.approx(
            [lp.logprob for lp in reference.logprobs], abs=1e-4
        )
        final = [c for d in sampled_deltas for c in d.outputs if c.index == index and c.finish_reason]
        assert len(final) == 1  # a finished completion is reported once
    assert sampled_deltas[-1].finished


def test_stop_string_ends_the_stream_and_frees_the_request_in_the_core(served, offline):
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    full = offline.generate(["Once upon a time"], long)[0].outputs[0]
    # A stop string early in the text, at its first occurrence.
    start = next(i for i in range(3, len(full.text) - 3) if full.text.find(full.text[i : i + 3]) == i)
    stop = full.text[start : start + 3]
    before = served.stats().num_generation_tokens
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, stop=[stop])

    async def run():
        deltas = await collect(served, "Once upon a time", params, "stopper")
        for _ in range(200):  # the abort reaches the core, which publishes fresh stats
            stats = served.stats()
            if stats.num_running == 0 and stats.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.01)
        return deltas, stats

    deltas, stats = asyncio.run(run())
    final = deltas[-1].outputs[0]
    assert deltas[-1].finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert joined(deltas)[1] == full.text[:start]
    assert (stats.num_running, stats.kv_cache_usage) == (0, 0.0)
    assert stats.num_generation_tokens - before < 80  # aborted in the core, not run to max_tokens


def test_refused_request_fails_alone(served):
    async def run():
        return await asyncio.gather(
            collect(served, "hi", GREEDY, "bad-adapter", "missing"),
            collect(served, [10**6], GREEDY, "bad-token"),
            collect(served, "hi", GREEDY, "good"),
        )

    bad_adapter, bad_token, good = asyncio.run(run())
    assert "unknown adapter 'missing'" in bad_adapter[-1].error
    assert "out of vocabulary" in bad_token[-1].error
    assert bad_token[-1].outputs[0].finish_reason == "error"
    assert good[-1].error is None and len(joined(good)[0]) == 12


@pytest.mark.slow
def test_killed_core_fails_every_stream_and_refuses_new_requests(text_model_dir):
    llm = start_core(text_model_dir)
    pid = llm.core_pid
    deaths = []
    llm.add_death_callback(deaths.append)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    async def stream(request_id, started: asyncio.Event):
        async for _ in llm.generate("Once upon a time", long, request_id):
            started.set()
        return "finished"

    async def run():
        events = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(stream(f"s{i}", e)) for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    try:
        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "SIGKILL" in str(results[0])
        assert llm.dead_error is not None and len(deaths) == 1
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(llm, "hi", GREEDY, "late"))
        assert wait_gone(pid, 5) and pid not in child_pids(os.getpid())
    finally:
        llm.shutdown()
        kill_quietly(pid)


_FRONT_END = textwrap.dedent(
    """
    import sys, time
    from engine import AsyncLLM, EngineConfig
    if __name__ == "__main__":
        config = EngineConfig(model=sys.argv[1], max_model_len=96, block_size=4)
        llm = AsyncLLM.from_config(config, skip_tokenizer_init=True, startup_timeout_s=120)
        print(llm.core_pid, flush=True)
        time.sleep(120)
    """
)


@pytest.mark.slow
def test_core_exits_when_its_front_end_is_killed(text_model_dir, tmp_path):
    script = tmp_path / "front_end.py"
    script.write_text(_FRONT_END)
    front = subprocess.Popen(
        [sys.executable, str(script), str(text_model_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    core_pid = None
    try:
        core_pid = int(front.stdout.readline())
        assert alive(core_pid)
        front.kill()
        front.wait(10)
        assert wait_gone(core_pid, 10), "the core outlived its front end"
    finally:
        front.kill()
        front.wait(10)
        if core_pid is not None:
            kill_quietly(core_pid)


@pytest.mark.slow
def test_core_that_cannot_start_says_why_and_leaves_nothing(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no weights
    before = set(child_pids(os.getpid()))
    with pytest.raises(EngineStartupError, match="could not start"):
        AsyncLLM.from_config(
            EngineConfig(model=str(tmp_path)), skip_tokenizer_init=True, startup_timeout_s=60
        )
    assert set(child_pids(os.getpid())) <= before


def test_structured_outputs_through_the_core_match_the_in_process_engine(served, offline):
    """Grammars need the tokenizer in the core (it masks the logits); the text is the front end's. A
    grammar that completes on an ordinary token keeps that token's text."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    cases = [
        ("Pick:", {"choice": ["yes", "no", "maybe later"]}, 0.0),
        ("Digits:", {"regex": r"[0-9]{3}-[a-c]{2}"}, 1.0),
        ("JSON:", {"json": schema}, 0.8),
    ]
    params = [SamplingParams(temperature=t, seed=7, max_tokens=40, structured_outputs=s) for _, s, t in cases]
    prompts = [prompt for prompt, _, _ in cases]
    expected = offline.generate(prompts, params)

    async def run():
        return await asyncio.gather(
            *(collect(served, p, s, f"so{i}") for i, (p, s) in enumerate(zip(prompts, params)))
        )

    for deltas, reference in zip(asyncio.run(run()), expected):
        assert deltas[-1].error is None
        assert joined(deltas) == (reference.outputs[0].token_ids, reference.outputs[0].text)
        assert deltas[-1].outputs[0].finish_reason == reference.outputs[0].finish_reason
