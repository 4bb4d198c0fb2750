"""Mixed prefill/decode steps: fused element-wise ops against the torch ops (issue 17's "before and after"),
or piecewise CUDA graphs against eager mixed steps (`--compare piecewise`).

    TRITON_INTERPRET=0 python3 benchmarks/mixed_step.py      # H100: shape S, N=64, 127 decoding requests
    TRITON_INTERPRET=0 python3 benchmarks/mixed_step.py --compare piecewise --chunks 512
    python3 benchmarks/mixed_step.py --smoke                 # tiny model on the CPU (checks that it runs)

Decode steps replay CUDA graphs; a step that also carries a prefill chunk replays piecewise graphs
(engine/piecewise_graphs.py: everything but attention, the attention kernels eager between the pieces)
or, with piecewise_cuda_graphs off, runs eagerly, one launch per op per layer. This measures such steps through the engine itself (scheduler, runner, sampler): `--decoding`
requests with adapters decode steadily, then, `--repeats` times per chunk size, one new request with a
prompt of that many tokens (and one output token) joins them, so the next step is a mixed step of the
decode rows and the whole chunk; the decode-only step after it is timed too. Scheduling is synchronous
here (each `step()` ends when its tokens are on the host), so a step's wall time is what it costs end to
end. The engine is built twice in one invocation, with the fused Triton element-wise ops
(engine/model/fused_ops.py: RMSNorm with the residual add, RoPE in place, SiLU-and-mul) and with the
torch ops (`--compare ops`), or with and without piecewise graphs (`--compare piecewise`, fused ops
both), and the CUDA kernels of one mixed step are counted and timed with the torch profiler: their sum is
the step's GPU time, and "wall / GPU" how far the host keeps the GPU waiting (1.0: never).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
from engine.model import fused_ops  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["S", "L"], default="S")
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--decoding", type=int, default=127, help="requests decoding through every step")
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 512, 1536], help="prefill chunk sizes")
    p.add_argument("--repeats", type=int, default=20, help="mixed steps timed per chunk size")
    p.add_argument(
        "--cprofile", action="store_true", help="the costliest Python functions of the mixed steps"
    )
    p.add_argument("--top", type=int, default=25, help="functions listed from the cProfile")
    p.add_argument(
        "--compare",
        choices=["ops", "piecewise"],
        default="ops",
        help="ops: fused Triton element-wise ops vs torch ops; piecewise: piecewise CUDA graphs vs eager",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = p.parse_args(argv)
    # make_engine reads these
    args.dtype, args.device = "bfloat16", "cuda" if torch.cuda.is_available() else "cpu"
    args.max_num_batched_tokens = 8192
    args.async_scheduling = False  # each step() ends when its tokens are on the host
    with_engine_defaults(args)
    if args.smoke:
        args.shape, args.dtype, args.device = "smoke", "float32", "cpu"
        args.adapters, args.decoding, args.chunks, args.repeats = 2, 4, [8, 32], 2
    args.max_num_seqs = args.decoding + 1
    if max(args.chunks) + args.decoding > args.max_num_batched_tokens:
        p.error("a chunk and the decode rows must fit one step's token budget")
    return args


def measure(args, model_dir: Path, adapters: list[Path], vocab_size: int, label: str) -> dict:
    """{chunk size: (mixed step ms, decode step ms)} and the CUDA kernels of one mixed step per size."""
    rng = random.Random(0)
    steps_needed = 8 + 2 * args.repeats * len(args.chunks)
    max_len = min(2048, max(max(args.chunks) + 2, 64 + steps_needed + 8))  # W1's max_position_embeddings
    engine = make_engine(args, model_dir, adapters, max_len, None)
    names = [f"a{i % len(adapters)}" if adapters else None for i in range(args.decoding + 1)]
    long_run = SamplingParams(
        temperature=0.0, max_tokens=max_len - 64, min_tokens=max_len - 64, ignore_eos=True
    )
    for i in range(args.decoding):
        engine.add_request(f"d{i}", [rng.randrange(3, vocab_size) for _ in range(64)], long_run, names[i])
    while engine.scheduler.num_waiting or not all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # every decoding request past its prompt (and its adapter resident)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    timings, kernels, python_profile = {}, {}, cProfile.Profile()
    for chunk in args.chunks:
        mixed, decode = [], []
        for k in range(args.repeats + 1):  # the first of each size unmeasured (its adapter's load)
            prompt = [rng.randrange(3, vocab_size) for _ in range(chunk)]
            engine.add_request(f"p{chunk}-{k}", prompt, one_token, names[k % len(names)])
            profiler = _kernel_counter(args) if k == args.repeats else None
            if args.cprofile and k:
                python_profile.enable()
            mixed_s = _timed_step(engine, args, profiler)
            python_profile.disable()
            decode_s = _timed_step(engine, args, None)
            if k:
                mixed.append(mixed_s)
                decode.append(decode_s)
            if profiler is not None:
                kernels[chunk] = kernel_times(profiler)
        timings[chunk] = (statistics.median(mixed) * 1e3, statistics.median(decode) * 1e3)
    fused = engine.runner.model.fused
    piecewise_replays = engine.runner.num_graph_replays[2]
    engine.shutdown()
    del engine
    w1.free_memory(torch.device(args.device))
    if args.cprofile:
        out = io.StringIO()
        pstats.Stats(python_profile, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"mixed steps, {label} (cProfile on: timings inflated):{out.getvalue()}")
    return {
        "label": label,
        "fused": fused,
        "timings": timings,
        "kernels": kernels,
        "piecewise_replays": piecewise_replays,
    }


def _kernel_counter(args):
    if args.device != "cuda":
        return None
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])


def kernel_times(profiler) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, total ms)} of the CUDA kernels the profiler saw."""
    times: dict[str, tuple[int, float]] = {}
    for event in profiler.events():
        if event.device_type.name == "CUDA":
            count, ms = times.get(event.name, (0, 0.0))
            times[event.name] = (count + 1, ms + event.time_range.elapsed_us() / 1e3)
    return times


def _timed_step(engine, args, profiler) -> float:
    if args.device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    if profiler is None:
        engine.step()
    else:
        with profiler:
            engine.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def report(args, runs: list[dict]) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    first = "element-wise ops" if args.compare == "ops" else "mixed steps"
    lines = [
        f"Mixed steps, shape {args.shape}, {args.dtype}, N={args.adapters}, {args.decoding} decoding requests "
        f"+ one prefill chunk, synchronous scheduling, median of {args.repeats}, {device}",
        "",
        f"| {first} | chunk (tokens) | mixed step (ms) | decode step after it (ms) | CUDA kernels per "
        "mixed step | their GPU time (ms) | wall / GPU | piecewise replays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for chunk, (mixed, decode) in run["timings"].items():
            kernels = run["kernels"].get(chunk)
            count, gpu, ratio = "-", "-", "-"
            if kernels:
                count = sum(n for n, _ in kernels.values())
                gpu_ms = sum(ms for _, ms in kernels.values())
                gpu, ratio = f"{gpu_ms:.2f}", f"{mixed / gpu_ms:.2f}"
            lines.append(
                f"| {run['label']} | {chunk} | {mixed:.2f} | {decode:.2f} | {count} | {gpu} | {ratio} | "
                f"{run['piecewise_replays']} |"
            )
    for run in runs:
        for chunk, kernels in run["kernels"].items():
            total = sum(ms for _, ms in kernels.values())
            lines += ["", f"{run['label']}, chunk {chunk}: {total:.2f} ms of kernels"]
            lines += ["", "| kernel | launches | ms |", "|---|---|---|"]
            top = sorted(kernels.items(), key=lambda item: -item[1][1])[:8]
            lines += [f"| {name[:90]} | {n} | {ms:.3f} |" for name, (n, ms) in top]
    if len(runs) == 2:
        lines.append("")
        for chunk in args.chunks:
            a, b = runs[0]["timings"][chunk][0], runs[1]["timings"][chunk][0]
            lines.append(f"- chunk {chunk}: {runs[0]['label']} / {runs[1]['label']} mixed step {a / b:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = w1.llama_config(args.shape)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = w1.make_model(Path(tmp) / "model", args.shape, dtype, device)
        adapters = w1.make_adapters(Path(tmp), model_dir, config, args.adapters, args.rank, dtype)
        if args.compare == "piecewise":  # fused ops both times
            for piecewise, label in ((True, "piecewise"), (False, "eager")):
                args.piecewise_cuda_graphs = piecewise
                runs.append(measure(args, model_dir, adapters, config.vocab_size, label))
        else:  # eager mixed steps, as issue 17 compared them
            args.piecewise_cuda_graphs = False
            runs.append(measure(args, model_dir, adapters, config.vocab_size, "fused"))
            fused_ops.supports_fused_rope = lambda head_dim: False  # LlamaModel then keeps the torch ops
            runs.append(measure(args, model_dir, adapters, config.vocab_size, "torch"))
    print(report(args, runs))


if __name__ == "__main__":
    main()
