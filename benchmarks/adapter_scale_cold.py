"""W2's cold-start mode (`benchmarks/adapter_scale.py --cold-start`): what a request for an adapter that is
nowhere near the GPU costs, against the same adapters warm, and what it costs the other tenants.

128 adapter names of tenant "cold" (rank 16 over all seven projections of shape S, over the 64 weight
sets), one request each, all sent at once; beside them, `--bystanders` requests of tenant "bystander" on
one adapter that is already resident. Per source of the cold adapters (`--cold-sources`):

    local   a file store, empty disk cache: store -> disk cache (a hard link, sha256) -> CPU tier -> GPU
    disk    the same server restarted on the same state dir: in the disk cache, not in the CPU tier or GPU
    s3      S3 through moto's server on loopback, empty disk cache: streamed into memory -> CPU tier -> GPU

each on its own server (`--max-loras` raised to hold every cold adapter, so the warm pass finds all of
them in GPU slots), after an unmeasured warm-up of both tenants: a cold pass, then a warm pass of the same
128 adapters on fresh prompts. Reported per source and pass: the cold tenant's TTFT p50 / p99, the
bystanders' TPOT p50, and the mean cold-start seconds from the server's
`loraserve_adapter_cold_start_seconds`; then cold over warm for the TTFT p50 and the bystanders' TPOT.

Targets (issue 35, H100, shape S): cold TTFT p50 <= 1.5x warm from the local disk cache, <= 2x from S3
on loopback; the bystanders' TPOT within 5%. S3 needs moto's server (`moto[server]`) in this process.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import w1_setup as w1
from benchmarks.adapter_scale_setup import (
    bodies,
    build_local_store,
    build_s3_store,
    make_weight_sets,
    ms,
    scrape,
    write_api_keys,
)
from benchmarks.serve import make_tokenizer, percentile
from benchmarks.serve_client import drive, free_port, serving

COLD, BYSTANDER = "cold", "bystander"  # the tenants
BUCKET = "w2-cold-adapters"


def main(args) -> dict:
    config = w1.llama_config(args.shape)
    dtype = getattr(torch, args.dtype)
    rank = 4 if args.quick else 16
    cold = [f"c{k:03d}" for k in range(args.cold_requests)]
    num_sets = min(args.num_weight_sets, args.cold_requests)
    names = {(COLD, name): k % num_sets for k, name in enumerate(cold)}
    names[COLD, "warmup"] = 0  # compiles the cold tenant's kernels before measuring
    names[BYSTANDER, "steady"] = 1
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        model_dir = w1.make_model(root / "model", args.shape, dtype, torch.device(args.device))
        make_tokenizer(model_dir, config.vocab_size)
        sets = make_weight_sets(root / "sets", model_dir, config, [rank], num_sets, dtype)
        from adapter_format.model_shape import ModelShape

        shape = ModelShape.from_hf_config(config)
        keys = write_api_keys(root / "keys.json", [COLD, BYSTANDER])
        print(f"model and {len(sets)} weight sets built in {time.perf_counter() - started:.0f} s", flush=True)
        state_root = args.state_dir or root
        if {"local", "disk"} & set(args.cold_sources):
            store = f"file://{root / 'store'}"
            build_local_store(root / "store", shape, rank, sets, names)
            state = state_root / "state-local"
            common = (args, model_dir, store, state, root / "keys.json", keys, cold, config, rank, {})
            local = serve(*common, seed=1)  # also fills the disk cache for "disk"
            if "local" in args.cold_sources:
                results["local"] = local
            if "disk" in args.cold_sources:  # restarted on the same state dir: CPU tier and GPU empty
                results["disk"] = serve(*common, seed=2)
        if "s3" in args.cold_sources:
            results["s3"] = run_s3(args, root, model_dir, shape, rank, sets, names, keys, cold, config)
    print()
    print(report(args, results))
    failures = [e for passes in results.values() for row in passes.values() for e in row["errors"]]
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return results


def run_s3(args, root, model_dir, shape, rank, sets, names, keys, cold, config) -> dict:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise SystemExit("--cold-sources s3 needs moto's server: pip install 'moto[server]'") from None
    import boto3

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    }  # fmt: skip
    os.environ.update(env)  # this process's store client (the uploads) reads the same endpoint and keys
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        started = time.perf_counter()
        url = f"s3://{BUCKET}/adapters"
        build_s3_store(url, endpoint, shape, rank, sets, names)
        print(f"s3: {len(names)} adapters uploaded in {time.perf_counter() - started:.0f} s", flush=True)
        state = (args.state_dir or root) / "state-s3"
        return serve(args, model_dir, url, state, root / "keys.json", keys, cold, config, rank, env, seed=3)
    finally:
        moto.stop()


def serve(args, model_dir, store_url, state_dir, keys_file, keys, cold, config, rank, env, seed: int) -> dict:
    """One server: warm-up, a cold pass and a warm pass (prompts drawn from `seed`, fresh for each
    server and pass). Returns {"cold": row, "warm": row}."""
    state_dir.mkdir(parents=True, exist_ok=True)
    metrics_port = free_port()
    slots = max(args.max_loras, len(cold) + 2)  # every cold adapter, the warm-up's and the bystanders'
    values = [
        "--model", str(model_dir), "--served-model-name", "w2", "--state-dir", str(state_dir),
        "--adapter-store", store_url, "--api-keys", str(keys_file), "--device", args.device,
        "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
        str(args.max_num_batched_tokens), "--max-model-len", str(args.max_prompt + args.output_tokens),
        "--block-size", "16", "--no-enable-prefix-caching", "--max-loras", str(slots),
        "--max-cpu-loras", str(max(args.max_cpu_loras, slots)), "--max-lora-rank", str(rank),
        "--metrics-port", str(metrics_port), "--max-concurrent-requests-per-tenant",
        str(10 * (len(cold) + args.bystanders)), "--log-level", "warning",
    ]  # fmt: skip
    if args.device == "cpu":
        values += ["--cpu-kv-cache-space", "0.1"]
    argv, log_path = values + args.server_arg, state_dir / f"server-{time.time_ns()}.log"
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    rng = random.Random(seed)

    def prompts(count: int) -> list[list[int]]:
        return w1.random_prompts(rng, config.vocab_size, count, args.min_prompt, args.max_prompt)

    def one_pass(models: list[str]) -> dict:
        """The cold tenant's requests and the bystanders', all at once."""
        requests = bodies(models, prompts(len(models)), args.output_tokens, keys[COLD])
        steady = ["steady"] * args.bystanders
        requests += bodies(steady, prompts(len(steady)), args.output_tokens, keys[BYSTANDER])
        before = scrape(metrics_url)
        samples, start, end = drive(server.url, requests, args.client_processes)
        after = scrape(metrics_url)
        mine, theirs = samples[: len(models)], samples[len(models) :]
        return {
            "ttft": [s.first - s.sent for s in mine if not s.error],
            "tpot": [(s.last - s.first) / max(1, s.num_tokens - 1) for s in theirs if not s.error],
            "errors": [s.error for s in samples if s.error],
            "cold_start": cold_start_means(before, after),
            "seconds": end - start,
        }

    with serving(argv, log_path, args.startup_timeout, env) as (server, ready_s):  # one_pass reads `server`
        print(f"{store_url.split(':')[0]} server ready in {ready_s:.0f} s", flush=True)
        # Warm-up, unmeasured: both tenants' adapters resident, every kernel of these shapes compiled.
        for _ in range(2):
            one_pass(["warmup"] * max(1, len(cold) // 4))
        rows = {"cold": one_pass(cold), "warm": one_pass(cold)}
        for name, row in rows.items():
            print(
                f"  {name} pass: TTFT p50 {ms(row['ttft'], 50):.0f} ms, bystander TPOT p50 "
                f"{ms(row['tpot'], 50):.1f} ms, {len(row['errors'])} failed",
                flush=True,
            )
        return rows


def cold_start_means(before: dict, after: dict) -> dict[str, float]:
    """Mean seconds of the cold starts during a pass, by source tier (from the server's histogram)."""
    means = {}
    for tier in ("cpu", "disk", "store"):
        key = ("loraserve_adapter_cold_start_seconds_count", tier)
        count = after.get(key, 0.0) - before.get(key, 0.0)
        total_key = ("loraserve_adapter_cold_start_seconds_sum", tier)
        if count:
            means[tier] = (after.get(total_key, 0.0) - before.get(total_key, 0.0)) / count
    return means


def report(args, results: dict) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [
        f"W2 cold start, shape {args.shape}, {args.dtype}, {args.cold_requests} cold adapters (one request each) "
        f"+ {args.bystanders} bystander requests at once, prompts [{args.min_prompt}, {args.max_prompt}], "
        f"{args.output_tokens} output tokens, {device}",
        "",
        "| source | pass | cold tenant TTFT p50 / p99 (ms) | bystander TPOT p50 (ms) | cold starts, mean s by tier | failed |",
        "|---|---|---|---|---|---|",
    ]
    for source, passes in results.items():
        for name, row in passes.items():
            tiers = ", ".join(f"{t} {s:.3f}" for t, s in row["cold_start"].items()) or "-"
            lines.append(
                f"| {source} | {name} | {ms(row['ttft'], 50):.0f} / {ms(row['ttft'], 99):.0f} | "
                f"{ms(row['tpot'], 50):.1f} | {tiers} | {len(row['errors'])} |"
            )
    lines.append("")
    for source, passes in results.items():
        cold, warm = passes["cold"], passes["warm"]
        if cold["ttft"] and warm["ttft"] and cold["tpot"] and warm["tpot"]:
            lines.append(
                f"- {source}: cold / warm TTFT p50 {percentile(cold['ttft'], 50) / percentile(warm['ttft'], 50):.2f}x; "
                f"bystander TPOT p50 {percentile(cold['tpot'], 50) / percentile(warm['tpot'], 50):.2f}x"
            )
    return "\n".join(lines)
