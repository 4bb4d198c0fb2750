"""Tensor parallelism's process lifecycle on the CPU (gloo): shutdown (explicit, `with`, garbage-collected)
within a bound and a second engine after it; one rank's shutdown frees its memory; a worker that hangs
or dies, and a parent killed with SIGKILL, leave no process behind; prompt logprobs and the graph steps
(decode and speculative verification, replayed uncaptured) over two ranks give one rank's results."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist
from factories import make_adapter, make_model
from processes import kill_quietly, wait_gone
from spec_decode_fixtures import EOS, VOCAB, echo_prompts

from engine import LLM, SamplingParams
from engine.cuda_graphs import UNCAPTURED_GRAPHS_ENV
from engine.parallel import workers as workers_module
from engine.parallel.workers import TensorParallelError

REPO = Path(__file__).resolve().parents[2]
ARGS = dict(
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=32,
    num_kv_blocks=48,
    block_size=4,
    max_model_len=48,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [3, 100, 200]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tp-life") / "model", seed=4)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def worker_processes(llm) -> list:
    return list(llm.engine.runner.parallel.workers.processes)


@pytest.mark.slow
def test_shutdown_with_block_and_collection_each_make_room_for_the_next_engine(model_dir):
    with LLM(model=str(model_dir), tensor_parallel_size=2, **ARGS) as llm:
        expected = tokens(llm.generate(PROMPTS, GREEDY))
        workers = worker_processes(llm)
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY)

    dropped = LLM(model=str(model_dir), tensor_parallel_size=2, **ARGS)  # dropped, never shut down
    assert tokens(dropped.generate(PROMPTS, GREEDY)) == expected
    workers = worker_processes(dropped)
    del dropped
    gc.collect()
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()

    llm = LLM(model=str(model_dir), tensor_parallel_size=2, **ARGS)
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
        workers = worker_processes(llm)
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 30  # the GPU test holds it to 10 s; CPU runners are shared
        llm.shutdown()  # idempotent
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()


def test_one_rank_shutdown_frees_the_model_cache_and_pool_while_the_llm_is_kept(model_dir):
    llm = LLM(model=str(model_dir), **ARGS)
    runner = llm.engine.runner
    held = [
        weakref.ref(runner.kv_caches[0][0]),
        weakref.ref(runner.model.model.embed_tokens.weight),
        weakref.ref(runner.lora_slots.weights),
    ]
    llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
    assert [r() for r in held] == [None, None, None]
    assert llm.closed and not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_hung_worker_becomes_a_tensor_parallel_error(model_dir, monkeypatch):
    monkeypatch.setattr(workers_module, "STEP_TIMEOUT_S", 3.0)
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, **ARGS)
    (worker,) = worker_processes(llm)
    try:
        os.kill(worker.pid, signal.SIGSTOP)  # alive, never answering: a collective that never completes
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="did not finish within 3 s"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - started < 30
        assert wait_gone(worker.pid, 10)
    finally:
        kill_quietly(worker.pid)
        llm.shutdown()
    assert not dist.is_initialized()


PARENT = """
import sys, time
from engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", block_size=4, max_model_len=48,
          num_kv_blocks=48, max_num_batched_tokens=32)
print("workers", *[p.pid for p in llm.engine.runner.parallel.workers.processes], flush=True)
params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
while sys.argv[2] == "busy":  # generating: the worker is in a collective or about to be
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("parent_state", ["idle", "busy"])
def test_a_parent_killed_with_sigkill_leaves_no_worker(model_dir, tmp_path, parent_state):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = (tmp_path / "parent.log").open("w+")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(model_dir), parent_state],
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
    )
    workers: list[int] = []
    try:
        line = _read_line(parent, timeout_s=180)
        assert line.startswith("workers"), line + _tail(log)
        workers = [int(pid) for pid in line.split()[1:]]
        time.sleep(1.0)
        parent.kill()
        parent.wait(timeout=10)
        assert all(wait_gone(pid, 10) for pid in workers), "a worker outlived its killed parent"
    finally:
        for pid in [parent.pid, *workers]:
            kill_quietly(pid)
        parent.wait(timeout=10)
        log.close()


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The next stdout line, waiting at most `timeout_s` (the child may die or hang)."""
    import select

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            return process.stdout.readline().decode()
        if process.poll() is not None:
            return ""
    return ""


def _tail(log) -> str:
    log.seek(0)
    return "\n" + log.read()[-3000:]


@pytest.mark.slow
def test_prompt_logprobs_over_ranks_equal_one_rank(model_dir, monkeypatch):
    """Rank 0 computes them; the workers join the vocabulary gathers of the same rows, in the same chunks
    (three rows at a time here, so a prompt spans several)."""
    from engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "MAX_LOGIT_ELEMENTS", 3 * 512)
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0),
    ]
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}, *PROMPTS]
    results = []
    for tp in (1, 2):
        with LLM(model=str(model_dir), tensor_parallel_size=tp, **ARGS) as llm:
            results.append(llm.generate(prompts, params))
    one, two = results
    assert tokens(one) == tokens(two)
    assert two[1].prompt_logprobs is None
    for a, b in ((one[0], two[0]), (one[2], two[2])):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) > 1
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert (x.token_id, x.rank, list(x.top)) == (y.token_id, y.rank, list(y.top))
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


@pytest.mark.slow
@pytest.mark.interpreted
def test_graph_steps_over_ranks_give_one_ranks_tokens(tmp_path, monkeypatch):
    """Decode and verification graph steps, replayed uncaptured on the interpreted kernels: rank 0's
    static buffers reach the worker's, and both replay the same bucket."""
    monkeypatch.setenv(UNCAPTURED_GRAPHS_ENV, "1")  # the workers inherit it
    model = make_model(
        tmp_path / "model", seed=1, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1, num_hidden_layers=1
    )
    adapter = make_adapter(
        model, tmp_path / "qv", seed=11, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    args = dict(
        skip_tokenizer_init=True,
        lora_modules={"qv": str(adapter)},
        max_loras=1,
        max_lora_rank=8,
        attention_backend="triton",
        dtype="float32",
        max_model_len=32,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    prompts, adapters = echo_prompts(2, length=6), ["qv", None]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(model), **args) as llm:
        expected = tokens(llm.generate(prompts, params, adapters))
    for spec in (None, ngram):
        with LLM(str(model), tensor_parallel_size=2, speculative_config=spec, **args) as llm:
            assert tokens(llm.generate(prompts, params, adapters)) == expected
            stats = llm.engine.stats()
            assert stats.num_decode_graph_replays > 0 or spec is not None
            if spec is not None:
                assert stats.num_verify_graph_replays > 0
