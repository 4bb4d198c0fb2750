"""The fused all-reduce + residual add + RMSNorm kernel (engine/parallel/fused_allreduce.py) against what it
replaces, NCCL's all-reduce then the fused add + RMSNorm kernel (engine/model/fused_ops.py), at decode
sizes: one process per GPU (spawned), each op captured `--reps` times in a CUDA graph as the decode graphs
capture them, the graph replayed `--iters` times after a warm-up, rank 0's time per op (CUDA events;
each op's time includes waiting for the slowest rank, as in a decode step). Bounded: every rank must
report within `--timeout` seconds, else the run is stopped and says so.

    NCCL_NVLS_ENABLE=0 python3 benchmarks/fused_allreduce.py                  # every GPU of the host
    NCCL_NVLS_ENABLE=0 python3 benchmarks/fused_allreduce.py --world 2 4      # 2 GPUs, then 4

A size past the fused path's bound (fused_allreduce.max_bytes) shows "-" in the fused column: NCCL's then.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue as queue_module
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
HIDDEN = [4096, 8192]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=None, help="ranks per run (default: all GPUs)")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--hidden", type=int, nargs="+", default=HIDDEN)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=20, help="ops captured in one graph")
    p.add_argument("--iters", type=int, default=20, help="graph replays timed")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one world size may take")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        p.error("needs 2 or more CUDA GPUs")
    args.world = args.world or [torch.cuda.device_count()]
    if max(args.world) > torch.cuda.device_count() or min(args.world) < 2:
        p.error(f"--world sizes must be 2..{torch.cuda.device_count()}")
    return args


def _graphed_time(op, reps: int, iters: int, device, barrier) -> float:
    """Seconds per `op()`, `reps` of them captured in one CUDA graph, replayed `iters` times."""
    op()  # compiled / communicator warm before capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            op()
    graph.replay()  # warm-up replay
    barrier()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def _time_size(group, hidden: int, tokens: int, dtype, args: dict) -> tuple:
    """(hidden, tokens, bytes, NCCL + add-norm seconds, fused seconds or None past the bound)."""
    import torch.distributed as dist

    from engine.model import fused_ops

    device, fused = group.device, group.fused_add_norm
    weight = torch.ones(hidden, dtype=dtype, device=device)
    partial = (torch.randn(tokens, hidden, device=device) * 0.01).to(dtype)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    reduced = (
        partial.clone()
    )  # reduced in place again and again: its values overflow, the time does not change

    def nccl_then_norm():
        dist.all_reduce(reduced, group=group.group)
        fused_ops.rms_norm(reduced, weight, 1e-6, residual)

    def one_kernel():
        fused(partial, residual, weight, 1e-6, False, None)

    def barrier():
        group.min(1)

    nccl = _graphed_time(nccl_then_norm, args["reps"], args["iters"], device, barrier)
    one = (
        _graphed_time(one_kernel, args["reps"], args["iters"], device, barrier)
        if fused.fits(partial)
        else None
    )
    return hidden, tokens, partial.numel() * partial.element_size(), nccl, one


def _rank(rank: int, world: int, port: int, args: dict, results) -> None:
    try:
        from engine.parallel.group import ParallelGroup

        device = torch.device("cuda", rank)
        group = ParallelGroup.join(rank, world, port, device)
        group.use_fused_add_norm(True)
        fused = group.fused_add_norm
        if fused is None:
            raise RuntimeError("the fused all-reduce could not be set up on these GPUs (see the log)")
        dtype = getattr(torch, args["dtype"])
        rows = [
            _time_size(group, hidden, tokens, dtype, args)
            for hidden in args["hidden"]
            for tokens in args["tokens"]
        ]
        results.put((rank, None, rows))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    results.close()
    results.join_thread()
    os._exit(0)  # no NCCL teardown (engine/parallel/group.py says why)


def run_world(world: int, args) -> list | str:
    """Rank 0's rows, or why there are none."""
    from engine.parallel.group import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, world, port, vars(args), results)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    got, error = {}, None
    try:
        while len(got) < world and error is None:
            try:
                rank, error, rows = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                error = (
                    f"ranks {sorted(set(range(world)) - set(got))} did not report within {args.timeout:.0f} s"
                )
                break
            got[rank] = rows
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return error if error is not None else got[0]


def report(args, per_world: dict[int, list | str], device_name: str) -> str:
    lines = [
        f"Fused all-reduce + residual add + RMSNorm vs NCCL all-reduce + fused add-norm kernel, {args.dtype}, "
        f"{device_name}, graphed ({args.reps} ops per graph, {args.iters} replays), rank 0's time per op",
        "",
        "| ranks | hidden | tokens | KiB | NCCL + add-norm (us) | fused (us) | NCCL / fused |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, rows in per_world.items():
        if isinstance(rows, str):
            why = (rows.strip().splitlines() or ["?"])[-1][:200].replace("|", "/")
            lines.append(f"| {world} | - | - | - | failed | | {why} |")
            continue
        for hidden, tokens, nbytes, nccl, fused in rows:
            fused_cell, ratio = (
                ("-", "-") if fused is None else (f"{fused * 1e6:.1f}", f"{nccl / fused:.2f}x")
            )
            lines.append(
                f"| {world} | {hidden} | {tokens} | {nbytes / 1024:.0f} | {nccl * 1e6:.1f} | {fused_cell} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    per_world = {}
    for world in args.world:
        per_world[world] = run_world(world, args)
        if isinstance(per_world[world], str):
            print(f"{world} ranks failed:\n{per_world[world]}", file=sys.stderr, flush=True)
    print()
    print(report(args, per_world, torch.cuda.get_device_name(0)))


if __name__ == "__main__":
    main()
