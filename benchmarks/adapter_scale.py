"""W2, adapter scale: 1,000 adapters with Zipf popularity against 8 used uniformly, one server, one invocation.

    python3 benchmarks/adapter_scale.py                 # shape S, bf16, rank 16 over all seven projections
    python3 benchmarks/adapter_scale.py --mixed-ranks   # ranks 8, 16 and 64 mixed, --max-lora-rank 64
    python3 benchmarks/adapter_scale.py --quick         # tiny model on the CPU, few requests (checks it runs)

`loraserve serve` runs from this checkout (benchmarks/serve_client.py) with W1's random-weight model of
shape S and a file adapter store holding 1,000 adapter names for the default tenant: 64 distinct weight
sets, each stored once through the store's own `put`, and the other names hard links to those files
under a manifest of their own, so building the store takes seconds. The server runs with
`--max-loras 64 --max-cpu-loras 128`, so most of the 1,000 start in the store and pass through the disk
cache, the CPU tier and a GPU slot while the benchmark runs.

Two measured workloads on the same server, after an unmeasured warm-up on the 8 adapters:
- "8 uniform": 1,000 requests over 8 other adapter names (to distinct weight sets), round robin;
- "1000 Zipf": 1,000 requests whose adapter is drawn from the 1,000 names with P(k) ~ 1/k (alpha 1).
Each request is a streaming /v1/completions with a random token-id prompt of U[128, 512] tokens and
exactly 128 output tokens (`ignore_eos`); 128 streams are kept in flight (a new request starts as one
ends). Reported per workload: output tok/s (all tokens over first send to last chunk), TTFT and TPOT
p50/p99 and the TTFT max, and from the server's /metrics (scraped before and after): the GPU-slot and
CPU-tier hit rates (per request arrival), the loads per second into the CPU tier (from the disk cache or
the store) and into GPU slots, and the disk cache's hit rate. The last line gives Zipf over uniform.

Targets (issue 19, H100): Zipf >= 0.9x the uniform tok/s and TTFT p99 <= 1.5x; mixed ranks >= 0.85x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# The repo root first: this folder's lora_kernels.py must not shadow the lora_kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.serve import make_tokenizer, percentile  # noqa: E402
from benchmarks.serve_client import Sample, Server, drive, free_port  # noqa: E402

TENANT = "default"  # the tenant every request runs as when the server has no API keys


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    adapters: list[str]  # one adapter name per request


# -- the adapter store ------------------------------------------------------------------------------


def make_weight_sets(root: Path, model_dir: Path, config, ranks: list[int], count: int, dtype) -> list[Path]:
    """`count` distinct PEFT folders over all seven projections; set i has rank ranks[i % len(ranks)]."""
    folders = []
    for rank in sorted(set(ranks)):
        indices = [i for i in range(count) if ranks[i % len(ranks)] == rank]
        made = w1.make_adapters(root / f"rank{rank}", model_dir, config, len(indices), rank, dtype)
        folders += list(zip(indices, made))
    return [folder for _, folder in sorted(folders)]


def build_store(store_root: Path, shape, max_lora_rank: int, sets: list[Path], names: dict[str, int]) -> None:
    """Store each weight set once with the store's `put`, then give every other name a version folder of
    hard links to those files and a manifest naming it (what `put` would write, minus the copies)."""
    from adapters_store.config import StoreConfig
    from adapters_store.filenames import MANIFEST_FILE
    from adapters_store.local import LocalStore

    store = LocalStore(
        store_root, StoreConfig(url=f"file://{store_root}", max_lora_rank=max_lora_rank), shape
    )
    committed = {}  # set index -> (its version folder, its record)
    for name, index in names.items():
        if index not in committed:
            record = store.put(TENANT, name, sets[index])
            committed[index] = (store_root / TENANT / name / str(record.version), record)
            continue
        source, record = committed[index]
        folder = store_root / TENANT / name / "1"
        folder.mkdir(parents=True)
        for file in source.iterdir():
            if file.name != MANIFEST_FILE:
                os.link(file, folder / file.name)
        (folder / MANIFEST_FILE).write_bytes(dataclasses.replace(record, name=name, version=1).to_json())


# -- workloads --------------------------------------------------------------------------------------


def zipf_names(names: list[str], num_requests: int, alpha: float, rng: random.Random) -> list[str]:
    """Draws with P(names[k]) proportional to 1 / (k + 1) ** alpha."""
    weights = [1.0 / (k + 1) ** alpha for k in range(len(names))]
    return rng.choices(names, weights=weights, k=num_requests)


def bodies(args, workload: Workload, prompts: list[list[int]]) -> list[dict]:
    return [
        {
            "model": adapter,
            "prompt": prompt,
            "max_tokens": args.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for adapter, prompt in zip(workload.adapters, prompts)
    ]


# -- the server's metrics ---------------------------------------------------------------------------


def scrape(metrics_url: str) -> dict[tuple[str, str], float]:
    """{(sample name, tier): value} of the adapter counters and load-time histograms."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10.0).text
    values = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("loraserve_adapter_"):
            continue
        for sample in family.samples:
            if "tier" in sample.labels and not sample.name.endswith(("_bucket", "_created")):
                values[sample.name, sample.labels["tier"]] = sample.value
    return values


def residency(before: dict, after: dict, seconds: float) -> dict:
    """Hit rates per tier and loads per second, from two scrapes around a run."""

    def delta(name: str, tier: str) -> float:
        return after.get((name, tier), 0.0) - before.get((name, tier), 0.0)

    def rate(tier: str) -> float:
        hits = delta("loraserve_adapter_cache_hits_total", tier)
        total = hits + delta("loraserve_adapter_cache_misses_total", tier)
        return hits / total if total else float("nan")

    return {
        "gpu_hit": rate("gpu"),
        "cpu_hit": rate("cpu"),
        "disk_hit": rate("disk"),
        "cpu_loads_s": delta("loraserve_adapter_load_seconds_count", "source") / seconds,
        "gpu_loads_s": delta("loraserve_adapter_load_seconds_count", "cpu") / seconds,
        "gpu_evictions": delta("loraserve_adapter_evictions_total", "gpu"),
    }


def summarize(samples: list[Sample], start: float, end: float) -> dict:
    ok = [s for s in samples if not s.error]
    return {
        "tok_s": sum(s.num_tokens for s in ok) / (end - start),
        "ttft": [s.first - s.sent for s in ok],
        "tpot": [(s.last - s.first) / max(1, s.num_tokens - 1) for s in ok],
        "errors": [s.error for s in samples if s.error],
        "seconds": end - start,
    }


# -- one server, every workload ----------------------------------------------------------------------


def server_args(args, model_dir: Path, store_root: Path, state_dir: Path, metrics_port: int) -> list[str]:
    values = [
        "--model", str(model_dir), "--served-model-name", "w2", "--state-dir", str(state_dir),
        "--adapter-store", f"file://{store_root}", "--device", args.device, "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_prompt + args.output_tokens), "--block-size", "16",
        "--no-enable-prefix-caching", "--max-loras", str(args.max_loras), "--max-cpu-loras",
        str(args.max_cpu_loras), "--max-lora-rank", str(max(args.ranks)), "--metrics-port", str(metrics_port),
        "--max-concurrent-requests-per-tenant", str(10 * args.concurrency), "--log-level", "warning",
    ]  # fmt: skip
    if args.device == "cpu":
        values += ["--cpu-kv-cache-space", "0.1"]
    return values + args.server_arg


def run(args, model_dir: Path, store_root: Path, state_dir: Path, workloads: list[Workload], prompts) -> dict:
    metrics_port = free_port()
    server = Server(
        server_args(args, model_dir, store_root, state_dir, metrics_port), state_dir / "server.log"
    )
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    rows = {}
    try:
        print(f"server ready in {server.wait_ready(args.startup_timeout):.0f} s", flush=True)
        if args.warmup_requests:  # the uniform adapters loaded and every kernel compiled before measuring
            warm_up = dataclasses.replace(
                workloads[0], adapters=workloads[0].adapters[: args.warmup_requests]
            )
            drive(server.url, bodies(args, warm_up, prompts), args.client_processes, args.concurrency)
        for workload in workloads:
            before = scrape(metrics_url)
            row = summarize(
                *drive(server.url, bodies(args, workload, prompts), args.client_processes, args.concurrency)
            )
            row.update(residency(before, scrape(metrics_url), row["seconds"]))
            rows[workload.name] = row
            print(
                f"{workload.name}: {row['tok_s']:.0f} output tok/s, {len(row['errors'])} failed", flush=True
            )
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        code = server.stop()
        if code not in (0, None):
            print(f"the server exited with {code}:\n{server.log_tail()}", file=sys.stderr)
    return rows


# -- report -----------------------------------------------------------------------------------------


def _rate(value: float) -> str:
    """A hit rate, or "-" where no request reached that tier (every adapter was found before it)."""
    return "-" if math.isnan(value) else f"{value:.1%}"


def report(args, rows: dict) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    ranks = "/".join(str(r) for r in args.ranks)
    lines = [
        f"W2, shape {args.shape}, {args.dtype}, {args.num_requests} requests, {args.concurrency} streams, "
        f"prompts [{args.min_prompt}, {args.max_prompt}], {args.output_tokens} output tokens, rank {ranks}, "
        f"--max-loras {args.max_loras} --max-cpu-loras {args.max_cpu_loras}, {device}",
        "",
        "| workload | output tok/s | TTFT p50 / p99 / max (ms) | TPOT p50 / p99 (ms) | GPU-slot hits | "
        "CPU-tier hits | disk hits | CPU-tier loads/s | GPU-slot loads/s | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        ttft = [1e3 * percentile(row["ttft"], q) for q in (50, 99, 100)]
        tpot = [1e3 * percentile(row["tpot"], q) for q in (50, 99)]
        lines.append(
            f"| {name} | {row['tok_s']:.0f} | {ttft[0]:.0f} / {ttft[1]:.0f} / {ttft[2]:.0f} | "
            f"{tpot[0]:.1f} / {tpot[1]:.1f} | {_rate(row['gpu_hit'])} | {_rate(row['cpu_hit'])} | "
            f"{_rate(row['disk_hit'])} | {row['cpu_loads_s']:.1f} | {row['gpu_loads_s']:.1f} | "
            f"{len(row['errors'])} |"
        )
    uniform, zipf = rows.values()
    if uniform["tok_s"] and uniform["ttft"]:  # else every uniform request failed: no ratio to give
        lines += [
            "",
            f"- Zipf / uniform: output tok/s {zipf['tok_s'] / uniform['tok_s']:.2f}x, TTFT p99 "
            f"{percentile(zipf['ttft'], 99) / percentile(uniform['ttft'], 99):.2f}x",
        ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-adapters", type=int, default=1000, help="adapter names of the Zipf workload")
    p.add_argument("--num-weight-sets", type=int, default=64, help="distinct weight sets behind the names")
    p.add_argument("--num-uniform", type=int, default=8, help="adapters of the uniform workload")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--mixed-ranks", action="store_true", help="ranks 8, 16 and 64 mixed, --max-lora-rank 64")
    p.add_argument("--num-requests", type=int, default=1000, help="requests per workload")
    p.add_argument("--concurrency", type=int, default=128, help="streams in flight")
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--max-cpu-loras", type=int, default=128)
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
    p.add_argument("--state-dir", type=Path, help="the server's --state-dir (default: a temporary folder)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    args.shape, args.device, args.dtype = "S", "cuda", "bfloat16"
    args.ranks = [8, 16, 64] if args.mixed_ranks else [16]
    if args.quick:
        args.shape, args.device, args.dtype = "smoke", "cpu", "float32"
        args.ranks = [2, 4, 8] if args.mixed_ranks else [4]
        args.num_adapters, args.num_weight_sets, args.num_uniform = 24, 6, 3
        args.num_requests, args.concurrency, args.warmup_requests = 10, 4, 0
        args.min_prompt, args.max_prompt, args.output_tokens = 8, 24, 4
        args.max_loras, args.max_cpu_loras, args.max_num_seqs, args.max_num_batched_tokens = 2, 4, 4, 64
        args.client_processes = 2
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --quick)")
    if args.num_uniform > args.num_weight_sets:
        p.error("--num-uniform must not exceed --num-weight-sets (each uniform adapter has its own weights)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = random.Random(0)
    config = w1.llama_config(args.shape)
    prompts = w1.random_prompts(rng, config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
    zipf = [f"z{k:04d}" for k in range(args.num_adapters)]  # z0000 the most popular
    uniform = [f"u{k}" for k in range(args.num_uniform)]
    names = {name: k % args.num_weight_sets for k, name in enumerate(zipf)}
    names.update({name: k for k, name in enumerate(uniform)})
    workloads = [
        Workload(f"{len(uniform)} uniform", [uniform[i % len(uniform)] for i in range(args.num_requests)]),
        Workload(f"{len(zipf)} Zipf", zipf_names(zipf, args.num_requests, args.zipf_alpha, rng)),
    ]
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        model_dir = w1.make_model(root / "model", args.shape, dtype, torch.device(args.device))
        make_tokenizer(model_dir, config.vocab_size)
        sets = make_weight_sets(root / "sets", model_dir, config, args.ranks, args.num_weight_sets, dtype)
        from adapter_format.model_shape import ModelShape

        build_store(root / "store", ModelShape.from_hf_config(config), max(args.ranks), sets, names)
        print(f"model and {len(names)} adapters built in {time.perf_counter() - started:.0f} s", flush=True)
        state_dir = args.state_dir or root / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        rows = run(args, model_dir, root / "store", state_dir, workloads, prompts)
    print()
    print(report(args, rows))
    print()
    summary = {
        name: {"tok_s": round(row["tok_s"], 1), "failed": len(row["errors"])} for name, row in rows.items()
    }
    print(json.dumps(summary))
    failures = [e for row in rows.values() for e in row["errors"]]
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return rows


if __name__ == "__main__":
    main()
