"""The spread between identical W1 runs on one offline engine, and what the host's CPU settings change.

    TRITON_INTERPRET=0 python3 benchmarks/run_spread.py              # H100: shape S, no LoRA
    TRITON_INTERPRET=0 python3 benchmarks/run_spread.py --adapters 64
    python3 benchmarks/run_spread.py --smoke                         # tiny model on the CPU

One engine (benchmarks/throughput.py's make_engine, async scheduling), W1's 128 requests run again and
again on fresh prompts, in phases: torch's default CPU threads; `torch.set_num_threads(1)`; the same with
`gc.freeze()`; the engine thread pinned to one core (`os.sched_setaffinity`, `--pin-core`); released to
every core again. Each run prints its output tok/s and its median step. A decode step of shape S is
host-bound, so runs of the same code differ by what the host does; this shows by how much.
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
from engine.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=0)
    p.add_argument("--runs", type=int, default=4, help="runs per phase")
    p.add_argument("--pin-core", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = p.parse_args(argv)
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

    def run(self, tag: str) -> None:
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
        print(f"| {tag} | {tok_s:.0f} | {statistics.median(steps) * 1e3:.2f} |", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = w1.llama_config(args.shape)
    every_core = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = w1.make_model(Path(tmp) / "model", args.shape, dtype, device)
        adapters = w1.make_adapters(Path(tmp), model_dir, config, args.adapters, args.rank, dtype)
        engine = make_engine(args, model_dir, adapters, args.max_prompt + args.output_tokens, None)
        runs = Runs(args, engine, config.vocab_size)
        print(
            f"shape {args.shape}, N={args.adapters}, {torch.get_num_threads()} torch threads, {len(every_core)} cores"
        )
        print("\n| run | output tok/s | median step (ms) |\n|---|---|---|")
        runs.run("warm-up")
        for i in range(args.runs):
            runs.run(f"default {i}")
        torch.set_num_threads(1)
        for i in range(args.runs):
            runs.run(f"1 torch thread {i}")
        gc.collect()
        gc.freeze()
        for i in range(args.runs):
            runs.run(f"1 torch thread, gc.freeze {i}")
        os.sched_setaffinity(0, {args.pin_core})  # this thread only: the engine's loop
        for i in range(args.runs):
            runs.run(f"pinned to core {args.pin_core} {i}")
        os.sched_setaffinity(0, every_core)
        for i in range(args.runs):
            runs.run(f"released {i}")
        engine.shutdown()


if __name__ == "__main__":
    main()
