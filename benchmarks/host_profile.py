"""Where the engine thread's time goes in a steady decode step (W1's shape, batch 128).

    python3 benchmarks/host_profile.py                  # H100: shape S, N=64 adapters
    python3 benchmarks/host_profile.py --adapters 0     # no LoRA
    python3 benchmarks/host_profile.py --smoke          # tiny model on the CPU (checks that it runs)

Runs W1's requests once unmeasured, then again, and over the steady decode steps of the second run (every
scheduled request decoding) times the engine's parts with wall clocks around them: the scheduler, the
runner's input preparation and launch, the sampler's launch, the wait for the sampled tokens and the
output bookkeeping. `--cprofile` also lists the Python functions that cost the most (it slows every call,
so the part times are then inflated); `--sync-debug` lists the lines that make the host wait for the GPU
(torch's sync debug mode), which must be only the wait for the sampled tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.step_profile import profile_decode_steps  # noqa: E402
from benchmarks.throughput import make_engine, with_engine_defaults  # noqa: E402
from engine.model import fused_ops  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


class PartTimer:
    """Wall time spent inside chosen methods, accumulated while `active`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, owner, attribute: str, label: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            if not self.active:
                return inner(*args, **kwargs)
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started

        setattr(owner, attribute, timed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["S", "L"], default="S")
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cprofile", action="store_true", help="list the costliest Python functions")
    p.add_argument("--top", type=int, default=30, help="functions listed from the cProfile")
    p.add_argument("--sync-debug", action="store_true", help="list the lines that wait for the GPU")
    p.add_argument("--kernel-profile", action="store_true", help="also the torch profiler's kernel times")
    p.add_argument(
        "--no-fused-ops", action="store_true", help="the torch element-wise ops instead of fused_ops (A/B)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    # make_engine reads these
    args.dtype, args.device = "bfloat16", "cuda" if torch.cuda.is_available() else "cpu"
    args.max_num_seqs, args.max_num_batched_tokens = args.num_requests, 8192
    with_engine_defaults(args)
    args.min_prompt, args.max_prompt = 128, 512
    if args.smoke:
        args.shape, args.dtype, args.device = "smoke", "float32", "cpu"
        args.num_requests = args.max_num_seqs = 8
        args.output_tokens, args.min_prompt, args.max_prompt, args.adapters = 12, 8, 24, min(args.adapters, 2)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = w1.llama_config(args.shape)
    rng = random.Random(0)
    prompts = w1.random_prompts(rng, config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        if args.no_fused_ops:
            fused_ops.supports_fused_rope = lambda head_dim: False  # LlamaModel then keeps the torch ops
        model_dir = w1.make_model(Path(tmp) / "model", args.shape, dtype, device)
        adapters = w1.make_adapters(Path(tmp), model_dir, config, args.adapters, args.rank, dtype)
        engine = make_engine(args, model_dir, adapters, args.max_prompt + args.output_tokens, None)
        names = [f"a{i % len(adapters)}" if adapters else None for i in range(len(prompts))]
        timer = PartTimer()
        timer.wrap(engine.scheduler, "schedule", "schedule")
        timer.wrap(engine.runner, "execute", "runner.execute (inputs + launch)")
        timer.wrap(engine.sampler, "launch", "sampler.launch")
        timer.wrap(engine, "_update", "_update (wait for tokens + outputs)")
        timer.wrap(engine.lora, "stage", "lora.stage")
        timer.wrap(engine.lora, "start_copies", "lora.start_copies")
        for round_ in ("warm", "measured"):
            for i, (prompt, adapter) in enumerate(zip(prompts, names)):
                engine.add_request(f"{round_}{i}", prompt, params, adapter)
            steps, seconds, profiler, syncs = 0, 0.0, cProfile.Profile(), Counter()
            while engine.has_unfinished_requests():
                steady = round_ == "measured" and engine.scheduler.num_waiting == 0 and _all_decoding(engine)
                timer.active = steady
                if steady and args.cprofile:
                    profiler.enable()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    debug_syncs = steady and args.sync_debug and device.type == "cuda"
                    if debug_syncs:
                        torch.cuda.set_sync_debug_mode("warn")
                    started = time.perf_counter()
                    engine.step()
                    elapsed = time.perf_counter() - started
                    if debug_syncs:
                        torch.cuda.set_sync_debug_mode(0)
                if steady:
                    profiler.disable()
                    seconds += elapsed
                    steps += 1
                    syncs.update(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        timer.active = False
        fused = "fused element-wise ops" if engine.runner.model.fused else "torch element-wise ops"
        scheduling = "async" if engine.config.async_scheduling else "sync"
        print(
            f"device {device}, shape {args.shape}, N={args.adapters}, batch {args.num_requests}, {fused}, {scheduling}"
        )
        note = " (cProfile on: inflated)" if args.cprofile else ""
        print(f"{steps} steady decode steps, {seconds / max(steps, 1) * 1e3:.2f} ms per step{note}")
        print()
        print("| part | ms per step | share |")
        print("|---|---|---|")
        for label, spent in sorted(timer.seconds.items(), key=lambda item: -item[1]):
            print(f"| {label} | {spent / max(steps, 1) * 1e3:.3f} | {spent / max(seconds, 1e-9):.0%} |")
        if args.sync_debug:
            print()
            print("| line that waits for the GPU | steps |")
            print("|---|---|")
            for line, count in syncs.most_common():
                print(f"| {line} | {count} |")
        if args.kernel_profile:
            print()
            print(profile_decode_steps(engine, prompts, names, args.output_tokens, device))
        if args.cprofile:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())


def _all_decoding(engine) -> bool:
    """Whether every running request is past its prompt (its next step is a one-token decode)."""
    return all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)


if __name__ == "__main__":
    main()
