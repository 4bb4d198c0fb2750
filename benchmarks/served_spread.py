"""The served path run to run: W1 over HTTP with 1, 2 and 4 front-end processes against the offline
engine, in one invocation, five measured runs per workload on fresh prompts.

    python3 benchmarks/served_spread.py                           # H100: shape S, no LoRA and N=64
    python3 benchmarks/served_spread.py --servers 1:off 1 2 4     # also one front end with no pinning
    python3 benchmarks/served_spread.py --sustained               # plus 1,024 requests at concurrency 128
    python3 benchmarks/served_spread.py --smoke                   # tiny model on the CPU (checks it runs)

Setup as benchmarks/serve.py (W1's random-weight model, a byte-level tokenizer of its vocabulary, N rank-16
adapters preloaded with `--lora-modules`, 128 streaming clients at once, 128 output tokens each). The
offline engine runs first, in a process of its own. Then, for each `--servers` entry `COUNT[:CPUS]`, one
server is started with `--api-server-count COUNT --engine-core-cpus CPUS` (CPUS default `auto`) and, per
workload:

    first      the first run after /ready, on prompts of its own (the issue's "first workload after
               /ready": its ratio to the median of the measured runs is reported)
    measured   `--runs` runs, each on fresh prompts (nothing in the prefix cache)
    sustained  with --sustained: `--sustained-requests` requests kept `--num-requests` in flight, once

The client processes (`--client-processes`) run off the engine core's CPUs (the plan `--engine-core-cpus`
makes on this host) and each reports its CPU time over its wall time: a client near 100% would be
setting the pace, so the report prints the busiest one for every server. The summary, last, has one line
per (server, workload): the median, min-max and slowest/median of the measured runs, served/offline,
TTFT p50 of the median run against the offline engine's, TPOT p99 / p50, and first run / median.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.serve import (  # noqa: E402
    make_tokenizer,
    one_run,
    percentile,
    run_offline,
    server_args,
    workload_name,
)
from benchmarks.serve_client import serving  # noqa: E402
from engine.core.steady import plan_cpus  # noqa: E402


@dataclass
class Served:
    """One server's results for one workload."""

    runs: list[dict] = field(default_factory=list)
    first: dict | None = None
    sustained: dict | None = None
    client_busy: float = 0.0  # the busiest client process's CPU share over every run

    def median_run(self) -> dict:
        return sorted(self.runs, key=lambda run: run["tok_s"])[(len(self.runs) - 1) // 2]


def parse_server(spec: str) -> tuple[int, str]:
    count, _, cpus = spec.partition(":")
    if not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: use COUNT or COUNT:CPUS, e.g. 2 or 1:off")
    return int(count), cpus or "auto"


def fresh_prompts(args, seed: int) -> list[list[int]]:
    vocab_size = w1.llama_config(args.shape).vocab_size
    return w1.random_prompts(
        random.Random(seed), vocab_size, args.num_requests, args.min_prompt, args.max_prompt
    )


def run_server(args, count: int, cpus: str, model_dir, adapters, max_len, state_dir: Path, seeds) -> dict:
    """{workload: Served} for one `--api-server-count COUNT --engine-core-cpus CPUS` server."""
    extra = ["--api-server-count", str(count), "--engine-core-cpus", cpus, "--metrics-port", "off"]
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [*server_args(args, model_dir, adapters, state_dir, max_len), *extra]
    plan = plan_cpus(cpus, cuda=args.device == "cuda")
    client_cpus = plan.others if plan is not None else None
    results: dict[str, Served] = {}
    with serving(argv, state_dir / "server.log", args.startup_timeout) as (server, ready_s):
        print(f"[{count} front end(s), cpus {cpus}] ready in {ready_s:.0f} s", flush=True)
        for n in args.workloads:
            served = results.setdefault(workload_name(n), Served())
            busy: list[float] = []
            client = {"cpus": client_cpus, "busy": busy}
            served.first = one_run(args, server.url, fresh_prompts(args, next(seeds)), n, **client)
            for _ in range(args.runs):
                served.runs.append(one_run(args, server.url, fresh_prompts(args, next(seeds)), n, **client))
            if args.sustained:
                many = [
                    p
                    for _ in range(-(-args.sustained_requests // args.num_requests))
                    for p in fresh_prompts(args, next(seeds))
                ]
                served.sustained = one_run(
                    args, server.url, many[: args.sustained_requests], n, args.num_requests, **client
                )
            served.client_busy = max(busy)
            runs = ", ".join(f"{run['tok_s']:.0f}" for run in served.runs)
            print(
                f"[{count} front end(s), cpus {cpus}] {workload_name(n)}: first {served.first['tok_s']:.0f}, "
                f"runs {runs} tok/s; busiest client {100 * served.client_busy:.0f}% CPU",
                flush=True,
            )
    return results


def summary_lines(args, served: dict, offline: dict) -> list[str]:
    lines = [
        "",
        f"Summary: W1 shape {args.shape}, {args.num_requests} streams, {args.output_tokens} output tokens, "
        f"{args.runs} measured runs per workload, "
        + (torch.cuda.get_device_name() if args.device == "cuda" else "CPU"),
        "",
        "| server | workload | median tok/s | min - max | slowest / median | served / offline | "
        "TTFT p50 ms (offline) | TPOT p99 / p50 | first / median | sustained tok/s | busiest client |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in offline.items():
        ttft = 1e3 * percentile(row["ttft"], 50)
        lines.append(f"| offline engine | {name} | {row['tok_s']:.0f} | | | | {ttft:.0f} | | | | |")
    for (count, cpus), per_workload in served.items():
        for name, result in per_workload.items():
            values = [run["tok_s"] for run in result.runs]
            median = statistics.median(values)
            base = offline.get(name)
            run = result.median_run()
            ttft = 1e3 * percentile(run["ttft"], 50)
            base_ttft = f" ({1e3 * percentile(base['ttft'], 50):.0f})" if base else ""
            tpot = percentile(run["tpot"], 99) / max(1e-9, percentile(run["tpot"], 50))
            sustained = f"{result.sustained['tok_s']:.0f}" if result.sustained else "-"
            lines.append(
                f"| {count} front end(s), cpus {cpus} | {name} | {median:.0f} | {min(values):.0f} - {max(values):.0f} | "
                f"{min(values) / median:.2f} | {median / base['tok_s'] if base else float('nan'):.2f} | "
                f"{ttft:.0f}{base_ttft} | {tpot:.2f} | {result.first['tok_s'] / median:.2f} | {sustained} | "
                f"{100 * result.client_busy:.0f}% |"
            )
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=parse_server, nargs="+", default=[(1, "auto"), (2, "auto"), (4, "auto")],
                   help="COUNT[:CPUS]: --api-server-count and --engine-core-cpus of each server, in order")  # fmt: skip
    p.add_argument("--adapters", type=int, nargs="+", default=[64], help="values of N (no LoRA always runs)")
    p.add_argument("--runs", type=int, default=5, help="measured runs per workload")
    p.add_argument("--sustained", action="store_true", help="also one sustained run per workload")
    p.add_argument("--sustained-requests", type=int, default=1024)
    p.add_argument("--shape", choices=["S", "L"], default="S")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128, help="concurrent streams")
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    args.device, args.dtype, args.fresh_cache = "cuda", "bfloat16", False
    # serve.py's server and floor helpers read these: one GPU, weights from the written checkpoint.
    args.tensor_parallel_size, args.load_format = 1, "auto"
    if args.smoke:
        args.shape, args.device, args.dtype = "smoke", "cpu", "float32"
        args.adapters, args.num_requests, args.min_prompt, args.max_prompt = [2], 4, 8, 24
        args.output_tokens, args.max_num_seqs, args.max_num_batched_tokens = 4, 4, 64
        args.client_processes, args.runs, args.sustained_requests = 2, 2, 6
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    args.workloads = [0, *[n for n in args.adapters if n]]
    args.adapters = [n for n in args.adapters if n]  # run_offline runs no LoRA and these
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    config = w1.llama_config(args.shape)
    prompts = w1.prompt_sets(
        random.Random(0), config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt
    )
    max_len = args.max_prompt + args.output_tokens
    dtype = getattr(torch, args.dtype)
    seeds = iter(range(10_000, 1_000_000))
    served: dict[tuple[int, str], dict] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = w1.make_model(root / "model", args.shape, dtype, torch.device(args.device))
        make_tokenizer(model_dir, config.vocab_size)
        adapters = w1.make_adapters(root, model_dir, config, max([0, *args.adapters]), args.rank, dtype)
        offline = {} if args.skip_offline else run_offline(args, model_dir, adapters, prompts, max_len)
        state_dir = root / "state"  # one for every server: the Triton cache compiled once serves them all
        for count, cpus in args.servers:
            served[(count, cpus)] = run_server(
                args, count, cpus, model_dir, adapters, max_len, state_dir, seeds
            )
            print(f"{time.perf_counter() - started:.0f} s so far", flush=True)
            if len(served) < len(args.servers):  # a run cut short by a timeout still shows what it measured
                print(
                    "\n".join(summary_lines(args, served, offline)).replace("Summary:", "So far:"), flush=True
                )
    print("\n".join(summary_lines(args, served, offline)))


if __name__ == "__main__":
    main()
