"""Tensor parallelism on GPUs: workload W1 at several tensor-parallel sizes in one invocation, each size in a
process of its own (a hang or crash costs that size's rows, never the run), compact table last.

    python3 benchmarks/tensor_parallel.py --shape L --tp 1 2 4          # W1-L, no LoRA and N=64, tp 1, 2, 4
    python3 benchmarks/tensor_parallel.py --shape 70B --tp 4            # a Llama-3.1-70B shape at tp 4
    python3 benchmarks/tensor_parallel.py --shape L --tp 1 2 4 --concurrent   # tp 1 and 2 side by side
    python3 benchmarks/tensor_parallel.py --shape 70B --tp 4 --fused-allreduce both   # NCCL, then fused
    python3 benchmarks/tensor_parallel.py --smoke                       # tiny, on the CPU (gloo), tp 1 and 2

Weights are random and made by the engine on each rank's GPU (`load_format="dummy"`): no checkpoint is
written or read (140 GB for the 70B shape), only config.json. Each size builds one engine (max(N)
adapters registered, `max_loras` of them) and runs each condition on it: requests without an adapter
("no LoRA", the same graphs and kernels as an engine without LoRA), then N adapters round robin. Each
condition runs twice: "cold" is the first run after start-up (adapters not yet resident; kernels compiled
by the engine's warm-up), "warm" a second run on other prompts. Adapters: `--distinct-adapters` weight
sets written as PEFT folders, registered under N names (every name is an adapter of its own to the
engine: its own CPU-tier row and GPU slot).

Per run: output tok/s, TTFT and TPOT p50/p99 (all requests arrive at once, TTFT includes queueing), the
median decode-only step at the largest batch against its per-GPU bytes floor (the shard of the weights,
the KV of the step's sequences, the adapters' shards, over the device-to-device copy bandwidth), and, for
the warm runs, rank 0's kernel time per decode step in NCCL collectives (torch profiler, 8 steps at the
largest batch; kernels inside CUDA-graph replays included; a collective's time includes waiting for the
slowest rank).

Sizes run one after another on GPUs 0.. by default. With `--concurrent`, sizes whose GPUs do not overlap
run at the same time on disjoint GPUs of the host (tp 1 on GPU 0 beside tp 2 on GPUs 1-2, then tp 4 on
0-3): each GPU still serves one engine alone, but the ranks share the host's CPUs and PCIe, which the
table's heading then says.

`--fused-allreduce on|both` runs each size above 1 with the all-reduce fused with the residual add and
RMSNorm (EngineArgs.fused_allreduce; `both`: without it, then with it, each in a process of its own;
the rows say "fused"), and the collectives column then gives the fused kernel's time per step too.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# The repo root first: this folder's lora_kernels.py must not shadow the lora_kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402

NCCL_KINDS = ("NCCL all-reduce", "NCCL all-gather", "NCCL broadcast", "fused all-reduce + norm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["S", "L", "70B"], default="L")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel sizes")
    p.add_argument("--adapters", type=int, default=64, help="N (0: no-LoRA runs only)")
    p.add_argument("--distinct-adapters", type=int, default=4, help="weight sets written for the N adapters")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one size may take, start-up included"
    )
    p.add_argument("--no-profile", action="store_true", help="skip the collective-time profile")
    p.add_argument(
        "--fused-allreduce",
        choices=["off", "on", "both"],
        default="off",
        help="sizes above 1 with the fused all-reduce + RMSNorm: off, on, or both (one run each)",
    )
    p.add_argument(
        "--concurrent", action="store_true", help="run sizes that fit side by side on disjoint GPUs at once"
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (gloo), tp 1 and 2")
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", "bfloat16"
    if args.smoke:
        args.shape, args.device, args.dtype, args.tp = "smoke", "cpu", "float32", [1, 2]
        args.adapters, args.distinct_adapters, args.num_requests = 2, 1, 6
        args.min_prompt, args.max_prompt, args.output_tokens = 8, 24, 4
        args.max_num_seqs, args.max_num_batched_tokens = 4, 64
    elif not torch.cuda.is_available():
        p.error("needs CUDA devices (or --smoke)")
    elif max(args.tp) > torch.cuda.device_count():
        p.error(f"--tp {max(args.tp)} needs that many GPUs; {torch.cuda.device_count()} are visible")
    return args


# -- one tensor-parallel size, in a process of its own ---------------------------------------------------


def placements(sizes: list[int], num_gpus: int, concurrent: bool, keys: list | None = None) -> list[list]:
    """Waves of (tp, first GPU): a wave's sizes run at once on disjoint GPUs, the waves one after another.
    Without `concurrent` each size is a wave of its own, on GPUs 0..tp-1. With `keys` (one per size), the
    waves hold (key, first GPU) instead."""
    keys = sizes if keys is None else keys
    if not concurrent:
        return [[(key, 0)] for key in keys]
    waves: list[list[tuple[int, int]]] = []
    for tp, key in zip(sizes, keys):
        for wave in waves:
            used = sum(size for size, _, _ in wave)
            if used + tp <= num_gpus:
                wave.append((tp, key, used))
                break
        else:
            waves.append([(tp, key, 0)])
    return [[(key, first) for _, key, first in wave] for wave in waves]


def variants(sizes: list[int], fused: str) -> list[tuple[int, bool]]:
    """(tp, fused all-reduce) per run: `fused` "off", "on" or "both" for the sizes above 1."""
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[fused]
    return [(tp, mode) for tp in sizes for mode in (modes if tp > 1 else (False,))]


def label(key: tuple[int, bool]) -> str:
    tp, fused = key
    return f"{tp} fused" if fused else str(tp)


def start_size(args, key, first_gpu: int, model_dir: Path, adapters: list[Path], prompts: w1.Prompts):
    """Every condition at size `tp` (key: tp, fused all-reduce), on GPUs first_gpu.., in a spawned process.
    Not a daemon: the engine starts worker (and adapter loader) processes of its own, which exit by
    themselves once it is gone."""
    tp, fused = key
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    values = dict(vars(args), first_gpu=first_gpu, fused_allreduce=fused)
    process = context.Process(
        target=_size_into, args=(results, values, tp, model_dir, adapters, prompts), name=f"tp{tp}"
    )
    process.start()
    return process, results


def collect_size(started, deadline: float) -> dict:
    """{"rows": [...]} or {"error": why} of a `start_size` process, waiting until `deadline` at most."""
    process, results = started
    try:
        return results.get(timeout=max(1.0, deadline - time.monotonic()))
    except Exception:  # queue.Empty: it hung (or died without a word)
        return {"error": f"no result within the timeout (exit code {process.exitcode})"}
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


def _size_into(results, arg_values: dict, tp: int, model_dir, adapters, prompts) -> None:
    try:
        results.put({"rows": _size(argparse.Namespace(**arg_values), tp, model_dir, adapters, prompts)})
    except BaseException as exc:  # report, then exit: the parent waits on the queue
        results.put({"error": "".join(traceback.format_exception(exc))[-2000:]})


def _size(args, tp: int, model_dir: Path, adapters: list[Path], prompts: w1.Prompts) -> list[dict]:
    from benchmarks.step_profile import decode_step_times
    from benchmarks.throughput import make_engine, measure_run, step_floor, with_engine_defaults

    device = torch.device(args.device)
    if device.type == "cuda":  # ranks on GPUs first_gpu .. first_gpu + tp - 1
        device = torch.device("cuda", args.first_gpu)
        args.device = str(device)
    element = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    bandwidth = w1.copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    config = w1.llama_config(args.shape)
    engine_args = with_engine_defaults(
        argparse.Namespace(**vars(args), tensor_parallel_size=tp, load_format="dummy")
    )
    max_len = args.max_prompt + args.output_tokens
    started = time.perf_counter()
    engine = make_engine(engine_args, model_dir, adapters, max_len, None)
    startup = time.perf_counter() - started
    rows = []
    try:
        for n in sorted({0, args.adapters}):
            names = [f"a{i % n}" if n else None for i in range(args.num_requests)]
            for run, run_prompts in (("cold", prompts.warm_up), ("warm", prompts.measured)):
                replays = engine.stats().num_decode_graph_replays
                result = measure_run(engine_args, engine, run, run_prompts, names, device)
                row = {
                    "condition": f"N={n}" if n else "no LoRA",
                    "run": run,
                    "tok_s": result.tokens_per_second,
                    "ttft": [percentile(result.ttft, q) for q in (50, 99)],
                    "tpot": [percentile(result.tpot, q) for q in (50, 99)],
                    "graph_replays": engine.stats().num_decode_graph_replays - replays,
                }
                steps = result.steady_decode()
                if steps:
                    row["step"] = statistics.median(s.seconds for s in steps)
                    row["batch"] = steps[0].num_seqs
                    row["floor"] = step_floor(
                        config, steps, args.rank, element, bandwidth, element, False, tp
                    )
                if run == "warm" and not args.no_profile:
                    _, wall, kinds = decode_step_times(engine, run_prompts, names, args.output_tokens, device)
                    row["collectives"] = {k: kinds.get(k, 0.0) for k in NCCL_KINDS}
                    row["profiled_step"] = wall
                rows.append(row)
                print(
                    f"tp={label((tp, args.fused_allreduce))} {row['condition']} {run}: {row['tok_s']:.0f} output tok/s",
                    file=sys.stderr,
                    flush=True,
                )
        compiles = engine.stats().num_kernel_compiles_after_ready
        parallel = engine.runner.parallel
        fused = None if parallel is None else parallel.group.fused_add_norm
        if args.fused_allreduce and fused is None:
            raise RuntimeError(
                "--fused-allreduce: the engine did not set the fused all-reduce up (see its log)"
            )
    finally:
        shutdown_started = time.perf_counter()
        engine.shutdown()
        shutdown = time.perf_counter() - shutdown_started
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    for row in rows:
        row.update(
            startup=startup, shutdown=shutdown, compiles=compiles, bandwidth=bandwidth, device=hardware
        )
    return rows


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


# -- report -----------------------------------------------------------------------------------------


def report(args, results: dict[tuple[int, bool], dict]) -> str:
    measured = [r for result in results.values() for r in result.get("rows", [])]
    bandwidth_note = (
        f"{measured[0]['device']}, copy bandwidth {measured[0]['bandwidth'] / 1e9:.0f} GB/s"
        if measured
        else ""
    )
    lines = [
        f"W1 over tensor-parallel sizes, shape {args.shape}, {args.dtype}, random weights (load_format dummy), "
        f"{args.num_requests} requests, prompts [{args.min_prompt}, {args.max_prompt}], {args.output_tokens} "
        f"output tokens, N={args.adapters} rank {args.rank} over all 7 projections, {bandwidth_note}"
        + (", sizes side by side on disjoint GPUs where they fit (--concurrent)" if args.concurrent else ""),
        "",
        "| tp | condition | run | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | decode step (ms) "
        "@ batch | per-GPU floor (ms) | step / floor | all-reduce / all-gather / broadcast / fused all-reduce "
        "+ norm (ms/step) | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    steps: dict[tuple, float] = {}
    tok_s: dict[tuple, float] = {}
    for key, result in results.items():
        tp = label(key)
        if "error" in result:
            why = (result["error"].strip().splitlines() or ["?"])[-1][:160].replace("|", "/")
            lines.append(f"| {tp} | - | - | failed | | | | | | | {why} |")
            continue
        for r in result["rows"]:
            step_cells = "- | - | -"
            if "step" in r:
                step_cells = f"{1e3 * r['step']:.2f} @ {r['batch']} | {1e3 * r['floor']:.2f} | {r['step'] / r['floor']:.2f}"
                if r["run"] == "warm":
                    steps[(key, r["condition"])] = r["step"]
            if r["run"] == "warm":
                tok_s[(key, r["condition"])] = r["tok_s"]
            collectives = "-"
            if "collectives" in r:
                collectives = " / ".join(f"{1e3 * r['collectives'].get(k, 0.0):.3f}" for k in NCCL_KINDS)
            note = (
                f"start-up {r['startup']:.0f} s, shutdown {r['shutdown']:.1f} s, {r['graph_replays']} graph "
                f"replays, {r['compiles']} compiles after ready"
            )
            lines.append(
                f"| {tp} | {r['condition']} | {r['run']} | {r['tok_s']:.0f} | {1e3 * r['ttft'][0]:.0f} / "
                f"{1e3 * r['ttft'][1]:.0f} | {1e3 * r['tpot'][0]:.1f} / {1e3 * r['tpot'][1]:.1f} | {step_cells} "
                f"| {collectives} | {note} |"
            )
    lines.append("")
    base = min(results)
    for (key, condition), step in sorted(steps.items()):
        # each size against the smallest one, and a fused run against the same size without it
        for other in {base, (key[0], False)} - {key}:
            if (other, condition) in steps:
                lines.append(
                    f"- {condition}, tp={label(key)} / tp={label(other)}: decode step "
                    f"{step / steps[(other, condition)]:.2f}x, output tok/s "
                    f"{tok_s[(key, condition)] / tok_s[(other, condition)]:.2f}x"
                )
    lora = f"N={args.adapters}"
    for key in results:
        if (key, lora) in tok_s and (key, "no LoRA") in tok_s:
            line = (
                f"- tp={label(key)}: {lora} / no LoRA output tok/s "
                f"{tok_s[(key, lora)] / tok_s[(key, 'no LoRA')]:.2f}x"
            )
            if (key, lora) in steps and (key, "no LoRA") in steps:
                line += f", decode step {steps[(key, lora)] / steps[(key, 'no LoRA')]:.2f}x"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = random.Random(0)
    config = w1.llama_config(args.shape)
    prompts = w1.prompt_sets(rng, config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
    dtype = getattr(torch, args.dtype)
    results = {}  # this process never touches a GPU: each size's process has them to itself
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = w1.make_model(root / "model", args.shape, dtype, torch.device("cpu"), weights=False)
        adapters = w1.make_adapters(
            root, model_dir, config, args.adapters, args.rank, dtype, distinct=args.distinct_adapters
        )
        num_gpus = torch.cuda.device_count() if args.device == "cuda" else max(args.tp)
        runs = variants(args.tp, args.fused_allreduce)
        waves = placements([tp for tp, _ in runs], num_gpus, args.concurrent, keys=runs)
        for number, wave in enumerate(waves, 1):
            started = time.perf_counter()
            running = {key: start_size(args, key, first, model_dir, adapters, prompts) for key, first in wave}
            deadline = time.monotonic() + args.timeout
            for key, handle in running.items():
                results[key] = collect_size(handle, deadline)
                outcome = "failed" if "error" in results[key] else "done"
                took = time.perf_counter() - started
                print(f"tp={label(key)} {outcome} after {took:.0f} s", file=sys.stderr, flush=True)
                if "error" in results[key]:
                    print(results[key]["error"], file=sys.stderr, flush=True)
            if number < len(waves):  # what is measured so far, should a later size outlast the caller
                print(
                    f"(partial, after {number} of {len(waves)} waves)\n{report(args, results)}\n",
                    file=sys.stderr,
                )
    print()
    print(report(args, results))


if __name__ == "__main__":
    main()
