"""Fair sharing between tenants: a flooding tenant against a light one, fair (VTC) vs first come first served.

    python3 benchmarks/fairness.py            # shape S (Llama-3.2-1B), bf16, on CUDA
    python3 benchmarks/fairness.py --smoke    # tiny shapes on the CPU (checks that it runs)

The offline engine (LLMEngine, no HTTP) with tenant keys on each request. Tenant A floods: all its
`--a-requests` requests (10x B's by default, prompts uniform in [--a-min-prompt, --a-max-prompt]) arrive
at t = 0. Tenant B sends `--b-requests` short requests, one every `--b-interval` seconds from t = 0.
Every request generates exactly its output tokens (ignore_eos). Three runs on fresh engines, each after
an unmeasured warm-up of the same shapes (Triton compiles, CUDA graphs):

    B alone          B's requests only, same arrival times (the baseline TTFT)
    flood, fcfs      A + B, first come first served
    flood, fair      A + B, virtual token counters by tenant (weights 1:1)

Reported: B's TTFT (its arrival to its first token, on the wall clock) p50/p99 per run, the ratio of
B's p99 under the flood to B alone, total throughput (prompt + output tokens over the makespan) of
fair vs fcfs, and the preemptions of each run (in brackets those that made room for a tenant below its
share; each costs recomputing the victim's tokens, here without prefix caching). A TTFT under the flood also includes the longer steps a fuller batch takes, which no
scheduling order removes: `--max-num-batched-tokens` trades that step time against throughput.
Imports: torch, transformers, safetensors and this repo only.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.request_meta import RequestMeta  # noqa: E402


@dataclass
class Arrival:
    at: float  # seconds after the run starts
    request_id: str
    tenant: str
    prompt: list[int]
    output_tokens: int


@dataclass
class RunResult:
    name: str
    ttft: dict[str, list[float]] = field(default_factory=dict)  # tenant -> TTFT of each request, seconds
    num_tokens: int = 0  # prompt + output
    num_output_tokens: int = 0
    makespan_s: float = 0.0
    num_preemptions: int = 0  # all of them: KV blocks ran out, or room made for a tenant below its share
    num_fairness_preemptions: int = 0  # the second kind (fair only)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.makespan_s if self.makespan_s else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def workload(args, vocab_size: int) -> tuple[list[Arrival], list[Arrival]]:
    rng = random.Random(0)

    def prompt(low: int, high: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(rng.randint(low, high))]

    flood = [
        Arrival(0.0, f"a{i}", "A", prompt(args.a_min_prompt, args.a_max_prompt), args.a_output_tokens)
        for i in range(args.a_requests)
    ]
    light = [
        Arrival(
            i * args.b_interval,
            f"b{i}",
            "B",
            prompt(args.b_min_prompt, args.b_max_prompt),
            args.b_output_tokens,
        )
        for i in range(args.b_requests)
    ]
    return flood, light


def make_engine(args, model_dir: Path, policy: str, max_len: int) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        enable_prefix_caching=False,
        num_kv_blocks=args.num_kv_blocks,
        scheduling_policy=policy,
    )
    return LLMEngine(config, skip_tokenizer_init=True)


def play(engine: LLMEngine, arrivals: list[Arrival], name: str) -> RunResult:
    """Add each request at its arrival time (wall clock), step until all finish, record first tokens."""
    pending = sorted(arrivals, key=lambda a: a.at)
    by_id = {a.request_id: a for a in arrivals}
    result = RunResult(name)
    first_token: set[str] = set()
    start = time.perf_counter()
    next_arrival = 0
    while next_arrival < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_arrival < len(pending) and pending[next_arrival].at <= now:
            a = pending[next_arrival]
            params = SamplingParams(
                temperature=0.0, max_tokens=a.output_tokens, min_tokens=a.output_tokens, ignore_eos=True
            )
            engine.add_request(a.request_id, a.prompt, params, meta=RequestMeta(tenant=a.tenant))
            next_arrival += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.001, pending[next_arrival].at - now)))
            continue
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            if output.request_id not in first_token and output.outputs[0].token_ids:
                first_token.add(output.request_id)
                a = by_id[output.request_id]
                ttft = time.perf_counter() - start - a.at
                result.ttft.setdefault(a.tenant, []).append(ttft)
    result.makespan_s = time.perf_counter() - start
    result.num_output_tokens = sum(a.output_tokens for a in arrivals)
    result.num_tokens = result.num_output_tokens + sum(len(a.prompt) for a in arrivals)
    return result


def run(args, model_dir: Path, policy: str, arrivals: list[Arrival], name: str, max_len: int) -> RunResult:
    w1.free_memory(torch.device(args.device))
    engine = make_engine(args, model_dir, policy, max_len)
    warm = [
        Arrival(0.0, f"warm-{a.request_id}", a.tenant, a.prompt, a.output_tokens)
        for a in arrivals[: args.warmup_requests]
    ]
    play(engine, warm, "warm-up")
    scheduler = engine.scheduler
    before = (scheduler.num_preemptions, scheduler.num_admission_preemptions)
    result = play(engine, arrivals, name)
    result.num_preemptions = scheduler.num_preemptions - before[0]
    result.num_fairness_preemptions = scheduler.num_admission_preemptions - before[1]
    engine.shutdown()
    del engine
    return result


def report(args, results: list[RunResult]) -> str:
    alone, fcfs, fair = results
    lines = [
        f"fairness benchmark: shape {args.shape}, {args.dtype}; A {args.a_requests} requests at t=0, prompts "
        f"[{args.a_min_prompt}, {args.a_max_prompt}], {args.a_output_tokens} output tokens; B {args.b_requests} "
        f"requests every {args.b_interval} s, prompts [{args.b_min_prompt}, {args.b_max_prompt}], "
        f"{args.b_output_tokens} output tokens; max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}",
        "",
        "| run | B TTFT p50 (ms) | B TTFT p99 (ms) | A TTFT p50 (s) | tokens/s (prompt + output) | makespan (s) "
        "| preemptions (for fairness) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        b, a = r.ttft.get("B", []), r.ttft.get("A", [])
        a_p50 = f"{percentile(a, 50):.2f}" if a else "-"
        lines.append(
            f"| {r.name} | {percentile(b, 50) * 1e3:.1f} | {percentile(b, 99) * 1e3:.1f} | {a_p50} | "
            f"{r.tokens_per_second:.0f} | {r.makespan_s:.2f} | {r.num_preemptions} ({r.num_fairness_preemptions}) |"
        )
    b_alone = percentile(alone.ttft["B"], 99)
    lines += [
        "",
        f"- B's TTFT p99 under the flood / alone: fair {percentile(fair.ttft['B'], 99) / b_alone:.2f}x, "
        f"fcfs {percentile(fcfs.ttft['B'], 99) / b_alone:.2f}x (target: fair within 1.5x)",
        f"- throughput fair / fcfs: {fair.tokens_per_second / fcfs.tokens_per_second:.3f} (target: >= 0.95)",
        f"- B's mean TTFT: alone {statistics.mean(alone.ttft['B']) * 1e3:.1f} ms, fair "
        f"{statistics.mean(fair.ttft['B']) * 1e3:.1f} ms, fcfs {statistics.mean(fcfs.ttft['B']) * 1e3:.1f} ms",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["S", "L"], default="S")
    p.add_argument("--a-requests", type=int, default=400)
    p.add_argument("--a-min-prompt", type=int, default=512)
    p.add_argument("--a-max-prompt", type=int, default=1024)
    p.add_argument("--a-output-tokens", type=int, default=128)
    p.add_argument("--b-requests", type=int, default=40)
    p.add_argument("--b-min-prompt", type=int, default=64)
    p.add_argument("--b-max-prompt", type=int, default=128)
    p.add_argument("--b-output-tokens", type=int, default=32)
    p.add_argument("--b-interval", type=float, default=0.1, help="seconds between B's arrivals")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: from gpu_memory_utilization")
    p.add_argument("--warmup-requests", type=int, default=48)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", "bfloat16"
    if args.smoke:
        args.shape, args.device, args.dtype = "smoke", "cpu", "float32"
        args.a_requests, args.a_min_prompt, args.a_max_prompt, args.a_output_tokens = 20, 24, 48, 4
        args.b_requests, args.b_min_prompt, args.b_max_prompt, args.b_output_tokens = 2, 4, 8, 2
        args.b_interval, args.max_num_seqs, args.max_num_batched_tokens = 0.01, 8, 64
        args.num_kv_blocks, args.warmup_requests = 256, 2
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    config = w1.llama_config(args.shape)
    flood, light = workload(args, config.vocab_size)
    max_len = max(args.a_max_prompt + args.a_output_tokens, args.b_max_prompt + args.b_output_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = w1.make_model(Path(tmp) / "model", args.shape, dtype, device)
        results = []
        for policy, arrivals, name in (
            ("fair", light, "B alone"),
            ("fcfs", flood + light, "flood, fcfs"),
            ("fair", flood + light, "flood, fair"),
        ):
            results.append(run(args, model_dir, policy, arrivals, name, max_len))
            print(f"{name}: done in {results[-1].makespan_s:.2f} s", flush=True)
    print()
    print(report(args, results))


if __name__ == "__main__":
    main()
