"""Tensor parallelism on the CPU (gloo): workload C1 over 2 and 4 ranks gives the greedy tokens of one rank
and of transformers + PEFT, for Llama, Mistral and Qwen2, through chunked prefill, preemption and adapter
slot evictions; workers are stopped with the engine, and a dead worker stops it with an error.
test_tensor_parallel_lifecycle.py covers shutdown, hangs, a killed parent, prompt logprobs and graph steps."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import random
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy
from processes import child_pids, kill_quietly, wait_gone
from safetensors.torch import load_file, save_file

from engine import LLM, AsyncLLM, SamplingParams
from engine.config import EngineConfig
from engine.parallel.workers import TensorParallelError

NUM_NEW_TOKENS = 16
ARCH_OVERRIDES = {
    "llama": {},
    "mistral": {"sliding_window": 12},  # prompts longer than the window exercise sliding attention
    "qwen2": {"tie_word_embeddings": True},  # q/k/v biases, tied (vocabulary-parallel) LM head
}
# Chunked prefill (8 tokens a step) and preemption (16 blocks of 4 tokens for 10 sequences of up to 56).
ENGINE_ARGS = dict(
    max_lora_rank=16,
    dtype="float32",
    max_num_seqs=16,
    max_num_batched_tokens=8,
    num_kv_blocks=16,
    block_size=4,
    max_model_len=64,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)


@pytest.fixture(scope="module", params=sorted(ARCH_OVERRIDES))
def c1_case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"tp-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=1, **ARCH_OVERRIDES[arch])
    adapters = {
        name: make_adapter(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    rng = random.Random(arch)
    names = [*adapters, None]
    # 10 prompts of 3..40 tokens: each adapter twice and the base model twice, mixed in every batch.
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 41))] for _ in range(10)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    reference_model = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference_model, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    return dict(
        arch=arch,
        model_dir=model_dir,
        adapters=adapters,
        prompts=prompts,
        assigned=assigned,
        expected=expected,
    )


@contextmanager
def engine(model_dir, **args):
    """An LLM whose workers are stopped however the test ends (and checked gone)."""
    llm = LLM(model=str(model_dir), **args)
    workers = [] if llm.engine.runner.parallel is None else llm.engine.runner.parallel.workers.processes
    try:
        yield llm
    finally:
        llm.engine.shutdown()
        assert not [p for p in workers if p.is_alive()], "a worker outlived the engine"


def tp_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tp-worker")]


def generate(llm, case, params=GREEDY):
    prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, adapters=case["assigned"])]


# max_loras 2 with 4 adapters: slots are evicted and refilled, and the workers must follow rank 0's choice.
@pytest.mark.slow
@pytest.mark.parametrize("tp, max_loras", [(1, 4), (2, 2), (4, 4)])
def test_c1_greedy_matches_one_rank_and_peft(c1_case, tp, max_loras):
    adapters = {k: str(v) for k, v in c1_case["adapters"].items()}
    with engine(
        c1_case["model_dir"],
        lora_modules=adapters,
        tensor_parallel_size=tp,
        max_loras=max_loras,
        **ENGINE_ARGS,
    ) as llm:
        assert generate(llm, c1_case) == c1_case["expected"]
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV cache was meant to force preemption"
        if max_loras < len(adapters):
            assert llm.engine.lora.allocator.num_evictions > 0
        if tp > 1:
            runner = llm.engine.runner
            assert runner.model.num_heads == 4 // tp  # this rank computes its heads only
            assert runner.kv_caches[0][0].shape[2] == max(1, 2 // tp)  # and caches its KV heads only


@pytest.mark.slow
def test_synchronous_scheduling_over_ranks(c1_case):
    """The C1 runs above schedule asynchronously (the default: a step's input tokens are still on rank 0's
    device when it is sent); the synchronous loop sends them from the host."""
    if c1_case["arch"] != "llama":
        pytest.skip("one architecture is enough for the step exchange")
    adapters = {k: str(v) for k, v in c1_case["adapters"].items()}
    args = {**ENGINE_ARGS, "async_scheduling": False}
    with engine(
        c1_case["model_dir"], lora_modules=adapters, tensor_parallel_size=2, max_loras=4, **args
    ) as llm:
        assert generate(llm, c1_case) == c1_case["expected"]


@pytest.mark.slow
def test_a_vocabulary_the_ranks_do_not_divide(tmp_path):
    """511 ids over 2 ranks: the second shard is zero-padded; its padding never becomes a logit."""
    model_dir = make_model(tmp_path / "model", seed=3, vocab_size=511)
    prompts = [{"prompt_token_ids": [510, 3, 255, 256, 7]}, {"prompt_token_ids": [1, 2, 509]}]
    with engine(model_dir, **ENGINE_ARGS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with engine(model_dir, tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        outputs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=3)
        )
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.runner.model.model.embed_tokens.weight.shape[0] == 256
        assert all(t < 511 for o in outputs for step in o.outputs[0].logprobs for t in step.top)


@pytest.mark.slow
def test_speculative_decoding_over_ranks(c1_case):
    """n-gram speculation: the verifying step's extra logits rows come from the gathered vocabulary."""
    if c1_case["arch"] != "llama":
        pytest.skip("one architecture is enough for the step exchange")
    adapters = {k: str(v) for k, v in c1_case["adapters"].items()}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    args = {**ENGINE_ARGS, "max_loras": 4, "lora_modules": adapters, "speculative_config": spec}
    # Repetitive prompts, so the n-gram lookup finds proposals.
    case = {**c1_case, "prompts": [[7, 8, 9, 10] * 4 + p[:4] for p in c1_case["prompts"]]}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)  # no min_tokens
    with engine(c1_case["model_dir"], **args) as llm:
        expected = generate(llm, case, params)
    with engine(c1_case["model_dir"], tensor_parallel_size=2, **args) as llm:
        assert generate(llm, case, params) == expected
        assert llm.engine.speculator.stats().num_draft_tokens > 0  # proposals were verified


def test_tensor_parallel_size_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model="m", tensor_parallel_size=0)


@pytest.mark.slow
def test_an_engine_dropped_without_shutdown_makes_room_for_the_next(c1_case):
    """One tensor-parallel engine per process at a time (one process group): a dropped one leaves its group."""
    if c1_case["arch"] != "llama":
        pytest.skip("one architecture is enough")
    prompt = [{"prompt_token_ids": c1_case["prompts"][0]}]
    gc.disable()  # no collection but the one the next engine's start runs
    try:
        dropped = LLM(model=str(c1_case["model_dir"]), tensor_parallel_size=2, **ENGINE_ARGS)
        expected = dropped.generate(prompt, GREEDY)[0].outputs[0].token_ids
        dropped.itself = dropped  # a reference cycle: only the collector frees it
        del dropped
        with engine(c1_case["model_dir"], tensor_parallel_size=2, **ENGINE_ARGS) as llm:
            assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    finally:
        gc.enable()
    assert tp_workers() == []


def test_one_rank_runs_no_worker_and_no_collective(c1_case):
    with engine(c1_case["model_dir"], **ENGINE_ARGS) as llm:
        assert llm.engine.runner.parallel is None
        assert type(llm.engine.runner.model).__name__ == "LlamaModel"
        assert tp_workers() == []


def test_heads_not_divisible_are_refused_before_any_worker_starts(c1_case):
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"
    ):
        LLM(model=str(c1_case["model_dir"]), tensor_parallel_size=3, **ENGINE_ARGS)
    assert tp_workers() == []


@pytest.mark.slow
def test_a_failed_start_leaves_no_worker_and_no_group(tmp_path):
    model_dir = make_model(tmp_path / "model", seed=2)
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights)
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="lacks tensor 'model.norm.weight'"):
        LLM(model=str(model_dir), tensor_parallel_size=2, **ENGINE_ARGS)
    assert tp_workers() == []
    assert torch.get_num_threads() == threads  # the CPU ranks' share of the cores was given back
    assert not torch.distributed.is_initialized()  # another engine may form a group in this process


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama"])
def test_a_dead_worker_stops_the_engine_with_an_error(tmp_path, arch):
    model_dir = make_model(tmp_path / "model", arch=arch, seed=2)
    with engine(model_dir, tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        (worker,) = llm.engine.runner.parallel.workers.processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="worker 1 failed"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)
        assert time.monotonic() - started < 30
    assert tp_workers() == []


def _worker_pids(core_pid: int) -> list[int]:
    """The core's tensor-parallel workers (its other children: multiprocessing's resource tracker)."""
    pids = []
    for pid in child_pids(core_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.slow
def test_served_core_runs_its_workers_and_none_outlives_it(text_model_dir):
    """`loraserve serve --tensor-parallel-size 2` runs the engine core in its own process: the workers are
    its children, the streams match one rank's, and killing the core (kill -9) takes the workers down."""
    args = dict(max_loras=2, max_lora_rank=8, max_model_len=96, block_size=4, max_num_seqs=8)
    prompts = ["Hello world", "The quick brown fox"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with engine(text_model_dir, **args) as offline:
        expected = [o.outputs[0].token_ids for o in offline.generate(prompts, greedy)]
    config = EngineConfig(model=str(text_model_dir), tensor_parallel_size=2, **args)
    llm = AsyncLLM.from_config(config, startup_timeout_s=120)
    core_pid, workers = llm.core_pid, []
    try:
        workers = _worker_pids(core_pid)
        assert len(workers) == 1

        async def run():
            async def tokens(i, prompt):
                deltas = [d async for d in llm.generate(prompt, greedy, f"r{i}")]
                return [t for d in deltas for c in d.outputs for t in c.token_ids]

            return await asyncio.gather(*(tokens(i, p) for i, p in enumerate(prompts)))

        assert asyncio.run(run()) == expected
        os.kill(core_pid, signal.SIGKILL)
        assert wait_gone(core_pid, 10)
        assert all(wait_gone(pid, 15) for pid in workers), "a worker outlived its engine core"
    finally:
        llm.shutdown()
        for pid in [core_pid, *workers]:
            kill_quietly(pid)
