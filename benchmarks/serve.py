"""Served W1: `loraserve serve` over HTTP against the offline engine, same workload, same invocation.

    python3 benchmarks/serve.py                  # shape S (Llama-3.2-1B), bf16, no LoRA / N=16 / N=64
    python3 benchmarks/serve.py --fresh-cache    # start from an empty Triton cache: first run vs later runs
    python3 benchmarks/serve.py --smoke          # tiny model on the CPU (checks that it runs)
    python3 benchmarks/serve.py --shape L --adapters 64 --tensor-parallel-size 2 --load-format dummy
                                                 # W1-L over two GPUs, served and offline (random weights
                                                 # made on the GPUs: no checkpoint written)

The server runs from this checkout (`python -m loraserve.cli serve`, engine core in its own process) with
W1's random-weight model, a synthetic byte-level tokenizer of the model's vocabulary (so detokenization
costs what it costs), and max(N) rank-16 adapters preloaded with `--lora-modules`. 128 streaming clients
(spread over `--client-processes` processes) each send one request at once: a random token-id prompt of
[128, 512] tokens, `ignore_eos`, 128 output tokens, adapters round robin. TTFT is the first content
chunk, TPOT (last chunk - first chunk) / (tokens - 1), output tok/s all tokens over first send to last
chunk. The offline engine (benchmarks/throughput.py's `run_engine`, in a process of its own so the GPU is
free for the server afterwards) runs the same requests; the decode step against its bytes floor is the
offline engine's (a server's step is not visible from outside).

Each served workload runs once unmeasured first (as the offline engine does, on prompts of its own so the
measured runs find nothing in the prefix cache), then `--repeats` times measured, each time on new
prompts; the report shows the median run and every run's tok/s, since on a host-bound step the spread
between identical runs is wide (docs/BENCHMARKS.md). With --fresh-cache the server starts on an empty
Triton cache under its --state-dir and the first run is measured too, against the later runs.

Dependencies. Preinstalled on the GPU machine: torch, triton, transformers, peft (and what they pull in:
safetensors, tokenizers, numpy, pyyaml, jinja2, huggingface-hub, ...). Carry these wheels along and
install them offline (`pip install --no-index --find-links wheels/ <names>`; pip skips what is there):
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

# The repo root first: this folder's lora_kernels.py must not shadow the lora_kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WHEELS = (
    "litestar msgspec uvicorn h11 click anyio sniffio idna typing-extensions multidict multipart rich-click rich "
    "markdown-it-py mdurl pygments polyfactory faker tzdata litestar-htmx importlib-resources zipp "
    "exceptiongroup pyzmq boto3 botocore s3transfer jmespath python-dateutil six urllib3 redis async-timeout "
    "prometheus-client pyyaml httpx httpcore certifi"
).split()
__doc__ += "\n    " + " ".join(WHEELS) + "\n"

import httpx  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.serve_client import Sample, drive, free_port, serving  # noqa: E402
from benchmarks.w1_setup import Prompts  # noqa: E402


def make_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens: the 256 byte symbols, then short words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    rng = random.Random(1)
    while len(vocab) < vocab_size:
        word = "Ġ" * rng.randint(0, 1) + "".join(
            rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7))
        )
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="!").save_pretrained(model_dir)


# -- offline --------------------------------------------------------------------------------------


def run_offline(args, model_dir: Path, adapters: list[Path], prompts: Prompts, max_len: int) -> dict:
    """benchmarks/throughput.py's engine runs, in a spawned process (its GPU memory is freed on exit).

    A plain (non-daemonic) process, not a Pool worker: the engine starts adapter loader processes of its own.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=_offline_into, args=(results, vars(args), model_dir, adapters, prompts, max_len)
    )
    process.start()
    try:
        ok, value = results.get(timeout=args.startup_timeout)  # every offline run together
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    if not ok:
        raise RuntimeError(f"the offline engine failed: {value}")
    return value


def _offline_into(results, *args) -> None:
    try:
        results.put((True, _offline(*args)))
    except BaseException as exc:  # report, then exit: the parent waits on the queue
        import traceback

        results.put((False, "".join(traceback.format_exception(exc))))


def _offline(arg_values: dict, model_dir: Path, adapters: list[Path], prompts: Prompts, max_len: int) -> dict:
    from benchmarks.throughput import run_engine, step_floor, with_engine_defaults

    # run_engine's options this benchmark does not vary: no profile, a warm-up run before the measured one,
    # and make_engine's defaults (async scheduling, bf16 weights).
    args = with_engine_defaults(argparse.Namespace(profile=False, no_warmup_run=False, **arg_values))
    config = w1.llama_config(args.shape)
    element = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    device = torch.device(args.device)
    bandwidth = w1.copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    rows = {}
    for n in [0, *args.adapters]:
        result, _ = run_engine(
            args, workload_name(n), model_dir, adapters[:n], prompts.measured, max_len, None, prompts.warm_up
        )
        row = {"tok_s": result.tokens_per_second, "ttft": result.ttft, "tpot": result.tpot}
        steps = result.steady_decode()
        if steps:
            kv_element = 1 if args.kv_cache_dtype.startswith("fp8") else element
            row["step"] = statistics.median(s.seconds for s in steps)
            row["floor"] = step_floor(
                config, steps, args.rank, element, bandwidth, kv_element, False, args.tensor_parallel_size
            )
            row["batch"] = steps[0].num_seqs
        rows[workload_name(n)] = row
        print(f"offline {workload_name(n)}: {result.tokens_per_second:.0f} output tok/s", flush=True)
    return rows


# -- served ---------------------------------------------------------------------------------------


def server_args(args, model_dir: Path, adapters: list[Path], state_dir: Path, max_len: int) -> list[str]:
    values = [
        "--model", str(model_dir), "--served-model-name", "w1", "--state-dir", str(state_dir),
        "--adapter-store", f"file://{state_dir / 'adapters'}", "--device", args.device, "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(max_len), "--block-size", "16", "--no-enable-prefix-caching",
        "--max-loras", str(max(1, len(adapters))), "--max-cpu-loras", str(max(1, len(adapters))),
        "--max-lora-rank", str(args.rank), "--kv-cache-dtype", args.kv_cache_dtype,
        "--max-concurrent-requests-per-tenant", str(10 * args.num_requests), "--log-level", "warning",
        "--tensor-parallel-size", str(args.tensor_parallel_size), "--load-format", args.load_format,
    ]  # fmt: skip
    if args.enforce_eager:
        values.append("--enforce-eager")
    if getattr(args, "piecewise_cuda_graphs", False):  # (served_spread.py's options lack it)
        values.append("--piecewise-cuda-graphs")
    if args.device == "cpu":
        values += ["--cpu-kv-cache-space", "0.1"]
    if adapters:
        values += ["--lora-modules", *(f"a{i}={path}" for i, path in enumerate(adapters))]
    return values


def bodies(args, prompts: list[list[int]], n: int) -> list[dict]:
    return [
        {
            "model": f"a{i % n}" if n else "w1",
            "prompt": prompt,
            "max_tokens": args.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i, prompt in enumerate(prompts)
    ]


def one_run(
    args, url: str, prompts: list[list[int]], n: int, concurrency: int | None = None, **client
) -> dict:
    """One run of the workload with `n` adapters (0: the base model) on `prompts`, summarized; `client`:
    drive's `cpus` and `busy`."""
    samples = drive(url, bodies(args, prompts, n), args.client_processes, concurrency, **client)
    return summarize(*samples)


def summarize(samples: list[Sample], start: float, end: float) -> dict:
    errors = [s.error for s in samples if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(samples)} requests failed, e.g. {errors[0]}")
    tokens = sum(s.num_tokens for s in samples)
    return {
        "tok_s": tokens / (end - start),
        "ttft": [s.first - s.sent for s in samples],
        "tpot": [(s.last - s.first) / max(1, s.num_tokens - 1) for s in samples],
    }


def run_served(args, model_dir, adapters, prompts: Prompts, max_len, state_dir: Path) -> tuple[dict, dict]:
    """({workload: row} of the measured runs, {workload: row} of first runs with --fresh-cache).

    Each workload's first run sends the warm-up prompts, each later run (`--repeats`) prompts of its own
    (`repeat_prompts`), so the prefix cache holds nothing a run sends: every run does the same work."""
    cache = state_dir / "cache" / "triton"
    if args.fresh_cache:
        shutil.rmtree(cache, ignore_errors=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    metrics_port = free_port()
    argv = [*server_args(args, model_dir, adapters, state_dir, max_len), "--metrics-port", str(metrics_port)]
    compiles = partial(compiles_after_ready, f"http://127.0.0.1:{metrics_port}")
    rows, first_rows = {}, {}
    with serving(argv, state_dir / "server.log", args.startup_timeout) as (server, ready_s):
        print(f"server ready in {ready_s:.0f} s; Triton cache entries: {_count(cache)}", flush=True)
        for n in [0, *args.adapters]:
            first = one_run(args, server.url, prompts.warm_up, n)
            if args.fresh_cache:
                first_rows[workload_name(n)] = first
                print(f"served {workload_name(n)} first run: {first['tok_s']:.0f} tok/s; cache entries "
                      f"{_count(cache)}; compiles after ready {compiles()}", flush=True)  # fmt: skip
            runs = []
            for repeat in range(args.repeats):
                runs.append(one_run(args, server.url, repeat_prompts(args, prompts, repeat), n))
                print(f"served {workload_name(n)}: {runs[-1]['tok_s']:.0f} output tok/s; compiles after ready "
                      f"{compiles()}", flush=True)  # fmt: skip
            rows[workload_name(n)] = median_run(runs)
        compiled = [
            line for line in server.log_path.read_text(errors="replace").splitlines() if "compiled" in line
        ]
        print(f"{len(compiled)} Triton compiles logged after ready", *compiled[:8], sep="\n", flush=True)
    return rows, first_rows


def repeat_prompts(args, prompts: Prompts, repeat: int) -> list[list[int]]:
    """The measured prompts, then for each further repeat prompts of its own (none in the prefix cache)."""
    if repeat == 0:
        return prompts.measured
    vocab_size = w1.llama_config(args.shape).vocab_size
    rng = random.Random(1000 + repeat)
    return w1.random_prompts(rng, vocab_size, args.num_requests, args.min_prompt, args.max_prompt)


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's tok/s beside it (the spread between repeats)."""
    ordered = sorted(runs, key=lambda run: run["tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "all_tok_s": [run["tok_s"] for run in runs]}


def compiles_after_ready(metrics_url: str) -> int:
    """The server's count of Triton compiles since /ready (meant to stay 0)."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        if family.name.startswith("loraserve_kernel_compiles_after_ready"):
            return int(sum(sample.value for sample in family.samples if sample.name.endswith("_total")))
    raise RuntimeError("the server's /metrics has no loraserve_kernel_compiles_after_ready")


def _count(folder: Path) -> int:
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


# -- report ---------------------------------------------------------------------------------------


def workload_name(n: int) -> str:
    return f"N={n}" if n else "no LoRA"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def row_cells(row: dict) -> str:
    ms = [1e3 * percentile(row[key], q) for key in ("ttft", "tpot") for q in (50, 99)]
    return f"{row['tok_s']:.0f} | {ms[0]:.0f} / {ms[1]:.0f} | {ms[2]:.1f} / {ms[3]:.1f}"


def report(args, served: dict, first: dict, offline: dict) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = [
        f"Served W1, shape {args.shape}, {args.dtype}, {args.num_requests} streaming clients, prompts "
        f"[{args.min_prompt}, {args.max_prompt}] tokens, {args.output_tokens} output tokens, rank {args.rank}, "
        f"tensor-parallel size {args.tensor_parallel_size}, weights {args.load_format}, {device}",
        "",
        "| workload | run | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | served / offline |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in served.items():
        base = offline.get(name)
        ratio = f"{row['tok_s'] / base['tok_s']:.2f}" if base else "-"
        if name in first:
            lines.append(f"| {name} | served, first run (fresh cache) | {row_cells(first[name])} | - |")
        lines.append(f"| {name} | served over HTTP | {row_cells(row)} | {ratio} |")
        if base:
            lines.append(f"| {name} | offline engine | {row_cells(base)} | |")
    steps = [(name, r) for name, r in offline.items() if "step" in r]
    if steps:
        lines.append("")
        for name, r in steps:
            lines.append(
                f"- offline decode step {name}: {1e3 * r['step']:.2f} ms @ batch {r['batch']}, floor "
                f"{1e3 * r['floor']:.2f} ms, {r['step'] / r['floor']:.2f}x"
            )
    for name, row in served.items():
        if len(row["all_tok_s"]) > 1:
            spread = ", ".join(f"{value:.0f}" for value in row["all_tok_s"])
            lines.append(f"- {name}: served runs {spread} tok/s (the median run is shown)")
    for name in first:
        later = served[name]["all_tok_s"]
        ratio, low, high = (
            first[name]["tok_s"] / value for value in (served[name]["tok_s"], max(later), min(later))
        )
        lines.append(
            f"- {name}: first run {ratio:.2f}x the later runs' median ({low:.2f}-{high:.2f}x their range)"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["S", "L"], default="S")
    p.add_argument("--adapters", type=int, nargs="+", default=[16, 64], help="values of N")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128, help="concurrent streaming clients")
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--piecewise-cuda-graphs",
        action="store_true",
        help="mixed prefill/decode steps as piecewise CUDA graphs (the engine's default: eager)",
    )
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument(
        "--fresh-cache",
        action="store_true",
        help="empty Triton cache: report the first run against the later ones",
    )
    p.add_argument("--repeats", type=int, default=3, help="measured served runs per workload (median shown)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--state-dir", type=Path, help="the server's --state-dir (default: a temporary folder)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the server's and the offline engine's model split over this many GPUs (the floor is per GPU)",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: the engines make the random weights on the GPUs (only config.json and the tokenizer "
        "are written)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", "bfloat16"
    if args.smoke:
        args.shape, args.device, args.dtype = "smoke", "cpu", "float32"
        args.adapters, args.num_requests, args.min_prompt, args.max_prompt = [1, 2], 6, 8, 24
        args.output_tokens, args.max_num_seqs, args.max_num_batched_tokens = 4, 4, 64
        args.client_processes, args.repeats = 2, 2
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rng = random.Random(0)
    config = w1.llama_config(args.shape)
    prompts = w1.prompt_sets(rng, config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
    max_len = args.max_prompt + args.output_tokens
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = args.load_format != "dummy"
        model_dir = w1.make_model(root / "model", args.shape, dtype, torch.device(args.device), weights)
        make_tokenizer(model_dir, config.vocab_size)
        adapters = w1.make_adapters(root, model_dir, config, max(args.adapters), args.rank, dtype)
        offline = {} if args.skip_offline else run_offline(args, model_dir, adapters, prompts, max_len)
        state_dir = args.state_dir or root / "state"
        started = time.perf_counter()
        served, first = run_served(args, model_dir, adapters, prompts, max_len, state_dir)
        print(f"served runs took {time.perf_counter() - started:.0f} s")
    print()
    print(report(args, served, first, offline))
    print()
    print(json.dumps({"served": _means(served), "offline": _means(offline)}, indent=None))


def _means(rows: dict) -> dict:
    return {name: round(row["tok_s"]) for name, row in rows.items()}


if __name__ == "__main__":
    main()
