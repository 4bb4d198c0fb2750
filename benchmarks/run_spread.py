"""The spread between identical W1 runs on one offline engine, and what the host's CPU settings change.

    TRITON_INTERPRET=0 python3 benchmarks/run_spread.py              # H100: shape S, no LoRA
    TRITON_INTERPRET=0 python3 benchmarks/run_spread.py --adapters 64 --runs 5
    python3 benchmarks/run_spread.py --smoke                         # tiny model on the CPU

One engine (benchmarks/throughput.py's make_engine, async scheduling), W1's 128 requests run again and
again on fresh prompts, in phases (`--phases`, in the order given, `--runs` runs each):

    default   the process as it starts: every CPU, torch's default CPU threads, the default collector
    steady    what the engine core process does before its loop (engine.core.steady): the loop's thread
              on the plan's CPU (`--engine-core-cpus`, auto as the server's), the other threads off it,
              one torch thread on CUDA, gc.freeze() and the higher young-generation threshold
    threads1  torch.set_num_threads(1) alone
    gcfreeze  one torch thread and gc.freeze() (no pinning)
    pinned    the engine thread alone pinned to `--pin-core`

Each phase starts from the default state (settings undone, the collector unfrozen). The default phases,
`default,steady,default,steady`, measure the server's steady settings before and after, twice over, so a
drift of the host over the minutes shows as a difference between the two rounds of one phase. Each run
prints its output tok/s and its median step; a summary per phase gives the median, the range, and the
slowest run against the median (the served target is >= 0.85x).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.throughput import make_engine, with_engine_defaults  # noqa: E402
from engine.core import steady  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PHASES = ("default", "steady", "threads1", "gcfreeze", "pinned")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=0)
    p.add_argument("--runs", type=int, default=4, help="runs per phase")
    p.add_argument("--phases", default="default,steady,default,steady", help=f"comma-separated, of {PHASES}")
    p.add_argument("--engine-core-cpus", default="auto", help="the steady phase's plan, as the server's flag")
    p.add_argument("--pin-core", type=int, default=2, help="the pinned phase's CPU")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = p.parse_args(argv)
    args.phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = [phase for phase in args.phases if phase not in PHASES]
    if unknown:
        p.error(f"unknown phase {unknown[0]!r}; use {', '.join(PHASES)}")
    # make_engine reads these
    args.shape, args.dtype, args.device, args.rank = "S", "bfloat16", "cuda", 16
    args.max_num_seqs, args.max_num_batched_tokens, args.num_requests = 128, 8192, 128
    args.min_prompt, args.max_prompt, args.output_tokens = 128, 512, 128
    with_engine_defaults(args)
    if args.smoke:
        args.shape, args.dtype, args.device = "smoke", "float32", "cpu"
        args.max_num_seqs = args.num_requests = 4
        args.min_prompt, args.max_prompt, args.output_tokens, args.runs = 8, 24, 4, 1
        args.adapters = min(args.adapters, 2)
        args.pin_core = min(args.pin_core, (os.cpu_count() or 1) - 1)
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    return args


class Runs:
    """W1's requests, again and again, on one engine."""

    def __init__(self, args, engine, vocab_size: int) -> None:
        self.args, self.engine, self.vocab_size = args, engine, vocab_size
        self.rng = random.Random(0)
        self.names = [f"a{i % args.adapters}" if args.adapters else None for i in range(args.num_requests)]
        self.params = SamplingParams(
            temperature=0.0, max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True
        )
        self.results: dict[str, list[float]] = {}

    def run(self, phase: str, tag: str) -> None:
        args = self.args
        prompts = w1.random_prompts(
            self.rng, self.vocab_size, args.num_requests, args.min_prompt, args.max_prompt
        )
        for i, (prompt, adapter) in enumerate(zip(prompts, self.names)):
            self.engine.add_request(f"{tag}-{i}", prompt, self.params, adapter)
        w1.sync(torch.device(args.device))
        started, steps = time.perf_counter(), []
        while self.engine.has_unfinished_requests():
            step_started = time.perf_counter()
            self.engine.step()
            steps.append(time.perf_counter() - step_started)
        seconds = time.perf_counter() - started
        tok_s = args.num_requests * args.output_tokens / seconds
        self.results.setdefault(phase, []).append(tok_s)
        print(f"| {tag} | {tok_s:.0f} | {statistics.median(steps) * 1e3:.2f} |", flush=True)


class HostSettings:
    """Applies one phase's settings to this process (the engine's thread is this one) and undoes them."""

    def __init__(self, args) -> None:
        self.args = args
        self.cuda = args.device == "cuda"
        self.cpus = os.sched_getaffinity(0) if steady.affinity_supported() else None
        self.threads = torch.get_num_threads()
        self.threshold = gc.get_threshold()

    def apply(self, phase: str) -> str:
        if phase == "steady":
            plan = steady.plan_cpus(self.args.engine_core_cpus, cuda=self.cuda)
            steady.enter_loop(plan, cuda=self.cuda)  # what the core does before its loop
            return plan.describe() if plan is not None else "no pinning (plan: none)"
        if phase in ("threads1", "gcfreeze"):
            torch.set_num_threads(1)
        if phase == "gcfreeze":
            gc.collect()
            gc.freeze()
        if phase == "pinned" and self.cpus is not None:
            os.sched_setaffinity(0, {self.args.pin_core})  # this thread only: the engine's loop
        return ""

    def undo(self) -> None:
        if self.cpus is not None:
            steady.pin_process(frozenset(self.cpus))
        torch.set_num_threads(self.threads)
        gc.unfreeze()
        gc.set_threshold(*self.threshold)


def summary(results: dict[str, list[float]]) -> list[str]:
    lines = ["", "| phase | runs | median tok/s | min - max | slowest / median |", "|---|---|---|---|---|"]
    for phase, values in results.items():
        median = statistics.median(values)
        lines.append(
            f"| {phase} | {len(values)} | {median:.0f} | {min(values):.0f} - {max(values):.0f} | "
            f"{min(values) / median:.2f} |"
        )
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = w1.llama_config(args.shape)
    host = HostSettings(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = w1.make_model(Path(tmp) / "model", args.shape, dtype, device)
        adapters = w1.make_adapters(Path(tmp), model_dir, config, args.adapters, args.rank, dtype)
        engine = make_engine(args, model_dir, adapters, args.max_prompt + args.output_tokens, None)
        runs = Runs(args, engine, config.vocab_size)
        cpus = len(host.cpus) if host.cpus is not None else os.cpu_count()
        print(f"shape {args.shape}, N={args.adapters}, {torch.get_num_threads()} torch threads, {cpus} cores")
        print("\n| run | output tok/s | median step (ms) |\n|---|---|---|")
        runs.run("warm-up", "warm-up")
        for round_index, phase in enumerate(args.phases):
            note = host.apply(phase)
            if note:
                print(f"| ({phase}: {note}) | | |", flush=True)
            for i in range(args.runs):
                runs.run(phase, f"{phase} {round_index}.{i}")
            host.undo()
        del runs.results["warm-up"]
        print("\n".join(summary(runs.results)))
        engine.shutdown()


if __name__ == "__main__":
    main()
