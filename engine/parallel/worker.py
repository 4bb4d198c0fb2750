"""A worker process: rank 1..N-1 of the tensor-parallel group.

It builds the same model runner as rank 0 (its own shard; the same collectives in the same order while
profiling memory and capturing CUDA graphs), then runs each step rank 0 sends until told to stop. It exits
when rank 0 says so, when rank 0's end of the pipe closes (rank 0 exited, however), or on an error, which
it reports first (`Failed`). A thread of its own exits the process once rank 0's process is gone, even
while the main thread waits inside a collective that will never complete.

A worker never tears its process group down: it exits with `os._exit`, and rank 0 aborts its own side
afterwards (engine/parallel/group.py says why).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import torch

from engine.lora.context import LoRAContext
from engine.parallel.messages import (
    EagerStep,
    Failed,
    GraphStep,
    Hello,
    Stop,
    VerifyStep,
    decode_to_worker,
    encode,
)
from engine.prompt_logprobs import logit_chunks

# How often a worker checks that rank 0's process still exists.
PARENT_POLL_S = 0.5


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after rank 0's; on the CPU every rank shares the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def worker_main(
    rank: int, world_size: int, port: int, config, model_path: str, max_model_len: int, conn, parent: int
) -> None:
    from engine.model.loader import load_config
    from engine.model_runner import ModelRunner
    from engine.parallel.group import ParallelGroup
    from engine.parallel.plan import ShardPlan
    from engine.parallel.rank import TensorParallelRank, cpu_threads_per_rank

    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="parent-watch", daemon=True).start()
    exit_code = 1
    try:
        conn.send_bytes(encode(Hello()))
        device = rank_device(config.torch_device, rank)
        if device.type == "cpu":  # as on rank 0 (TensorParallelRank.start)
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        config = dataclasses.replace(config, device=str(device))
        hf_config = load_config(Path(model_path))
        group = ParallelGroup.join(rank, world_size, port, device)
        plan = ShardPlan.for_model(hf_config, world_size, config.quantization, config.enable_expert_parallel)
        runner = ModelRunner(
            config, Path(model_path), hf_config, max_model_len, TensorParallelRank(plan, group)
        )
        serve(runner, conn)
        exit_code = 0
    except BaseException as exc:  # start-up errors (a bad shard, no memory) and step failures
        try:
            conn.send_bytes(encode(Failed(f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
    finally:
        conn.close()
    # No interpreter teardown: destroying a process group whose peers are gone can block.
    os._exit(exit_code)


def _exit_when_orphaned(parent: int) -> None:
    """Rank 0's process is gone (killed, say): nobody will send a step or complete a collective."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def serve(runner, conn) -> None:
    while True:
        try:
            step = decode_to_worker(conn.recv_bytes())
        except EOFError:
            return  # rank 0 closed the pipe (it exited)
        if isinstance(step, Stop):
            return
        run_step(runner, step)


@torch.inference_mode()
def run_step(runner, step: EagerStep | GraphStep | VerifyStep) -> None:
    """This rank's part of rank 0's step (the logits stay with rank 0; a worker drops its copy)."""
    parallel = runner.parallel
    parallel.apply_loads(step.loads)
    if isinstance(step, GraphStep):
        parallel.receive_graph(runner.inputs.decode, step.size)
        runner.graphs.replay(step.num_seqs, step.size, step.use_lora)
        return
    if isinstance(step, VerifyStep):
        parallel.receive_verify(runner.verify_graphs.inputs, step.size)
        runner.verify_graphs.replay(step.size, step.use_lora)
        return
    input_ids, meta, token_slots, logits_rows, prompt_rows = parallel.receive_eager(step)
    lora = None
    if token_slots is not None:  # as rank 0's: adapters' own embeddings and heads whenever there are slots
        lora = LoRAContext(runner.lora_slots, token_slots, vocab=runner.lora_slots.vocab is not None)
    hidden = runner.model.forward(input_ids, meta, runner.kv_caches, lora)

    def compute_logits(rows) -> None:  # this rank's columns (its own heads' rows too) join the gather
        own = lora.own_heads(rows) if lora is not None and lora.vocab else None
        runner.model.compute_logits(hidden[rows], own)

    if prompt_rows is not None:  # rank 0's prompt logprob gathers, in its chunks (engine/prompt_logprobs.py)
        for chunk in logit_chunks(prompt_rows.numel(), step.prompt_chunk_rows):
            compute_logits(prompt_rows[chunk])
    compute_logits(logits_rows)
