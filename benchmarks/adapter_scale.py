"""W2, adapter scale: 1,000 adapters with Zipf popularity against 8 used uniformly, rank 16 and ranks mixed.

    python3 benchmarks/adapter_scale.py                      # both variants, medians of 3 runs each
    python3 benchmarks/adapter_scale.py --variants rank16    # rank 16 over all seven projections only
    python3 benchmarks/adapter_scale.py --variants mixed     # ranks 8, 16 and 64 mixed, --max-lora-rank 64
    python3 benchmarks/adapter_scale.py --cold-start         # cold adapters against warm (adapter_scale_cold.py)
    python3 benchmarks/adapter_scale.py --smoke              # tiny model on the CPU, few requests (or --quick)

Each variant runs one `loraserve serve` from this checkout (benchmarks/serve_client.py) with W1's
random-weight model of shape S and a file adapter store holding 1,000 adapter names for the default
tenant: 64 distinct weight sets, each stored once through the store's own `put`, and the other names
hard links to those files under a manifest of their own, so building the store takes seconds. The server
runs with `--max-loras 64 --max-cpu-loras 256` (and whatever `--server-arg` adds), so most of the
1,000 start in the store and pass through the disk cache, the CPU tier and a GPU slot while the
benchmark runs. The mixed variant gives the 64 weight sets ranks 8, 16 and 64 in turn.

On each server, after an unmeasured warm-up on the 8 uniform adapters, `--runs` rounds of two
workloads, each round on prompts of its own (nothing of an earlier round in the prefix cache):
- "8 uniform": 1,000 requests over 8 other adapter names (to distinct weight sets), round robin;
- "1000 Zipf": 1,000 requests whose adapter is drawn from the 1,000 names with P(k) ~ 1/k (alpha 1),
  the popularity order shuffled anew each round, so every round starts as cold as the first.
Each request is a streaming /v1/completions with a random token-id prompt of U[128, 512] tokens and
exactly 128 output tokens (`ignore_eos`); 128 streams are kept in flight (a new request starts as one
ends). Reported per workload: the round of median throughput (output tok/s, TTFT p50/p99/max, TPOT
p50/p99, and from the server's /metrics scraped around it: GPU-slot, KV-tier, CPU-tier and disk-cache
hit rates, loads per second into the CPU tier and into GPU slots (those from KV blocks apart), the KV
tier's copies lost to requests and blocks held at the end) with every round's tok/s beside it; then Zipf
over uniform: the medians' tok/s and TTFT p99.

Targets (issue 35, H100, shape S): Zipf >= 0.95x the uniform tok/s and TTFT p99 <= 1.3x; mixed
ranks >= 0.85x; docs/BENCHMARKS.md has the commands and the results.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The repo root first: this folder's lora_kernels.py must not shadow the lora_kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.adapter_scale_setup import (  # noqa: E402,F401 (zipf_names, residency: the tests' too)
    DEFAULT_TENANT,
    bodies,
    build_local_store,
    hit_rate,
    make_weight_sets,
    ms,
    residency,
    scrape,
    summarize,
    zipf_names,
)
from benchmarks.serve import make_tokenizer, percentile  # noqa: E402
from benchmarks.serve_client import drive, free_port, serving  # noqa: E402

VARIANTS = {"rank16": None, "mixed": (8, 16, 64)}  # variant -> ranks in turn (None: the shape's one rank)


def variant_ranks(args, variant: str) -> list[int]:
    if args.quick:
        return [2, 4, 8] if variant == "mixed" else [4]
    return list(VARIANTS[variant] or (16,))


def server_args(
    args, model_dir: Path, store_root: Path, state_dir: Path, metrics_port: int, max_rank: int
) -> list[str]:
    values = [
        "--model", str(model_dir), "--served-model-name", "w2", "--state-dir", str(state_dir),
        "--adapter-store", f"file://{store_root}", "--device", args.device, "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_prompt + args.output_tokens), "--block-size", "16",
        "--no-enable-prefix-caching", "--max-loras", str(args.max_loras), "--max-cpu-loras",
        str(args.max_cpu_loras), "--max-lora-rank", str(max_rank), "--metrics-port", str(metrics_port),
        "--max-concurrent-requests-per-tenant", str(10 * args.concurrency), "--log-level", "warning",
    ]  # fmt: skip
    if args.device == "cpu":
        values += ["--cpu-kv-cache-space", "0.1"]
    return values + args.server_arg


def round_workloads(args, uniform: list[str], zipf: list[str], vocab_size: int, round_index: int):
    """(name, adapters per request, prompts) of one round: fresh prompts, a fresh Zipf popularity order."""
    rng = random.Random(1000 + round_index)
    order = list(zipf)
    if round_index:
        rng.shuffle(order)  # round 0 keeps z0000 the most popular
    prompts = [
        w1.random_prompts(rng, vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
        for _ in range(2)
    ]
    return [
        (
            f"{len(uniform)} uniform",
            [uniform[i % len(uniform)] for i in range(args.num_requests)],
            prompts[0],
        ),
        (f"{len(zipf)} Zipf", zipf_names(order, args.num_requests, args.zipf_alpha, rng), prompts[1]),
    ]


def run_variant(args, variant: str, root: Path, model_dir: Path, config, dtype) -> dict:
    """One server: warm-up, then `args.runs` rounds of both workloads. Returns {workload: [row per round]}."""
    ranks = variant_ranks(args, variant)
    zipf = [f"z{k:04d}" for k in range(args.num_adapters)]  # z0000 the most popular in round 0
    uniform = [f"u{k}" for k in range(args.num_uniform)]
    names = {(DEFAULT_TENANT, name): k % args.num_weight_sets for k, name in enumerate(zipf)}
    names.update({(DEFAULT_TENANT, name): k for k, name in enumerate(uniform)})
    started = time.perf_counter()
    sets = make_weight_sets(root / variant / "sets", model_dir, config, ranks, args.num_weight_sets, dtype)
    from adapter_format.model_shape import ModelShape

    store_root = root / variant / "store"
    build_local_store(store_root, ModelShape.from_hf_config(config), max(ranks), sets, names)
    print(f"{variant}: {len(names)} adapter names built in {time.perf_counter() - started:.0f} s", flush=True)
    state_dir = (args.state_dir or root) / f"state-{variant}"
    state_dir.mkdir(parents=True, exist_ok=True)
    metrics_port = free_port()
    argv = server_args(args, model_dir, store_root, state_dir, metrics_port, max(ranks))
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    rows: dict[str, list[dict]] = {}
    with serving(argv, state_dir / "server.log", args.startup_timeout) as (server, ready_s):
        print(f"{variant}: server ready in {ready_s:.0f} s", flush=True)
        if args.warmup_requests:  # the uniform adapters loaded and every kernel compiled before measuring
            rng = random.Random(7)
            prompts = w1.random_prompts(
                rng, config.vocab_size, args.warmup_requests, args.min_prompt, args.max_prompt
            )
            warm = [uniform[i % len(uniform)] for i in range(args.warmup_requests)]
            drive(
                server.url, bodies(warm, prompts, args.output_tokens), args.client_processes, args.concurrency
            )
        for round_index in range(args.runs):
            for name, adapters, prompts in round_workloads(
                args, uniform, zipf, config.vocab_size, round_index
            ):
                before = scrape(metrics_url)
                samples = drive(
                    server.url,
                    bodies(adapters, prompts, args.output_tokens),
                    args.client_processes,
                    args.concurrency,
                )
                row = summarize(*samples)
                row.update(residency(before, scrape(metrics_url), row["seconds"]))
                rows.setdefault(name, []).append(row)
                print(
                    f"{variant} round {round_index + 1}/{args.runs}, {name}: {row['tok_s']:.0f} output tok/s, "
                    f"TTFT p99 {ms(row['ttft'], 99):.0f} ms, {len(row['errors'])} failed",
                    flush=True,
                )
    return rows


# -- report -----------------------------------------------------------------------------------------


def median_row(rows: list[dict]) -> dict:
    """The round of median throughput, with every round's tok/s and the median of each round's TTFT p99."""
    ordered = sorted(rows, key=lambda row: row["tok_s"])
    return {
        **ordered[(len(ordered) - 1) // 2],
        "all_tok_s": [row["tok_s"] for row in rows],
        "median_ttft_p99": statistics.median(percentile(row["ttft"], 99) for row in rows),
    }


def report(args, variant: str, rows: dict[str, list[dict]]) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    ranks = "/".join(str(r) for r in variant_ranks(args, variant))
    lines = [
        f"W2 {variant}, shape {args.shape}, {args.dtype}, {args.num_requests} requests, {args.concurrency} "
        f"streams, prompts [{args.min_prompt}, {args.max_prompt}], {args.output_tokens} output tokens, rank "
        f"{ranks}, --max-loras {args.max_loras} --max-cpu-loras {args.max_cpu_loras} "
        f"{' '.join(args.server_arg)}, medians of {args.runs} rounds, {device}".replace("  ", " "),
        "",
        "| workload | output tok/s (median; every round) | TTFT p50 / p99 / max (ms) | TPOT p50 / p99 (ms) | "
        "GPU-slot hits | KV-tier hits | CPU-tier hits | disk hits | CPU-tier loads/s | GPU-slot loads/s "
        "(from KV) | KV copies lost / blocks held | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    medians = {name: median_row(runs) for name, runs in rows.items()}
    for name, row in medians.items():
        every = " / ".join(f"{t:.0f}" for t in row["all_tok_s"])
        failed = sum(len(r["errors"]) for r in rows[name])
        lines.append(
            f"| {name} | {row['tok_s']:.0f} ({every}) | {ms(row['ttft'], 50):.0f} / {ms(row['ttft'], 99):.0f} / "
            f"{ms(row['ttft'], 100):.0f} | {ms(row['tpot'], 50):.1f} / {ms(row['tpot'], 99):.1f} | "
            f"{hit_rate(row['gpu_hit'])} | {hit_rate(row['kv_hit'])} | {hit_rate(row['cpu_hit'])} | "
            f"{hit_rate(row['disk_hit'])} | {row['cpu_loads_s']:.1f} | {row['gpu_loads_s']:.1f} "
            f"({row['kv_loads_s']:.1f}) | {row['kv_evictions']:.0f} / {row['kv_blocks']:.0f} | {failed} |"
        )
    uniform, zipf = medians.values()
    if uniform["tok_s"] and uniform["ttft"]:  # else every uniform request failed: no ratio to give
        lines += [
            "",
            f"- Zipf / uniform ({variant}): output tok/s {zipf['tok_s'] / uniform['tok_s']:.2f}x, TTFT p99 "
            f"{zipf['median_ttft_p99'] / uniform['median_ttft_p99']:.2f}x (medians of {args.runs} rounds)",
        ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="rank16,mixed", help="comma-separated: rank16, mixed")
    p.add_argument("--mixed-ranks", action="store_true", help="the mixed variant alone (--variants mixed)")
    p.add_argument("--runs", type=int, default=3, help="rounds of both workloads per variant (medians)")
    p.add_argument("--num-adapters", type=int, default=1000, help="adapter names of the Zipf workload")
    p.add_argument("--num-weight-sets", type=int, default=64, help="distinct weight sets behind the names")
    p.add_argument("--num-uniform", type=int, default=8, help="adapters of the uniform workload")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=1000, help="requests per workload and round")
    p.add_argument("--concurrency", type=int, default=128, help="streams in flight")
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--max-cpu-loras", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--warmup-requests", type=int, default=256, help="unmeasured, on the uniform adapters")
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for `loraserve serve` (repeatable), e.g. --server-arg=--adapter-loader=thread "
        "where /dev/shm cannot hold the CPU tier",
    )
    p.add_argument("--state-dir", type=Path, help="folder for the servers' --state-dir (default: temporary)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument(
        "--quick",
        "--smoke",
        action="store_true",
        help="tiny model on the CPU, few requests (checks that it runs)",
    )
    p.add_argument(
        "--cold-start", action="store_true", help="cold adapters against warm (adapter_scale_cold.py)"
    )
    p.add_argument("--cold-sources", default="local,disk,s3", help="comma-separated: local, disk, s3")
    p.add_argument("--cold-requests", type=int, default=128, help="cold adapters, one request each")
    p.add_argument("--bystanders", type=int, default=16, help="another tenant's requests beside each pass")
    args = p.parse_args(argv)
    args.variants = (
        ["mixed"] if args.mixed_ranks else [v.strip() for v in args.variants.split(",") if v.strip()]
    )
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants takes {', '.join(VARIANTS)} (got {unknown or 'none'})")
    args.cold_sources = [s.strip() for s in args.cold_sources.split(",") if s.strip()]
    if args.runs < 1:
        p.error("--runs must be at least 1")
    args.shape, args.device, args.dtype = "S", "cuda", "bfloat16"
    if args.quick:
        args.shape, args.device, args.dtype = "smoke", "cpu", "float32"
        args.num_adapters, args.num_weight_sets, args.num_uniform = 24, 6, 3
        args.num_requests, args.concurrency, args.warmup_requests = 10, 4, 0
        args.min_prompt, args.max_prompt, args.output_tokens = 8, 24, 4
        args.max_loras, args.max_cpu_loras, args.max_num_seqs, args.max_num_batched_tokens = 2, 4, 4, 64
        args.client_processes, args.cold_requests, args.bystanders = 2, 6, 2
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    if args.num_uniform > args.num_weight_sets:
        p.error("--num-uniform must not exceed --num-weight-sets (each uniform adapter has its own weights)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.cold_start:
        from benchmarks import adapter_scale_cold

        return adapter_scale_cold.main(args)
    config = w1.llama_config(args.shape)
    dtype = getattr(torch, args.dtype)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        model_dir = w1.make_model(root / "model", args.shape, dtype, torch.device(args.device))
        make_tokenizer(model_dir, config.vocab_size)
        print(f"model built in {time.perf_counter() - started:.0f} s", flush=True)
        for variant in args.variants:
            results[variant] = run_variant(args, variant, root, model_dir, config, dtype)
    for variant, rows in results.items():
        print()
        print(report(args, variant, rows))
    print()
    summary = {
        variant: {name: {"tok_s": round(median_row(runs)["tok_s"], 1), "failed": sum(len(r["errors"]) for r in runs),
                         **{tier: _rate(median_row(runs)[tier]) for tier in ("gpu_hit", "kv_hit", "cpu_hit")}}
                  for name, runs in rows.items()}
        for variant, rows in results.items()
    }  # fmt: skip
    print(json.dumps(summary))
    failures = [
        e for rows in results.values() for runs in rows.values() for row in runs for e in row["errors"]
    ]
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return results


def _rate(value: float) -> float | None:
    """A hit rate for the JSON summary: None where no lookup reached the tier."""
    return None if value != value else round(value, 3)


if __name__ == "__main__":
    main()
