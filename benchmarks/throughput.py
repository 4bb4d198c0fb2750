"""End-to-end throughput, workload W1 (docs/ARCHITECTURE.md): the engine with N adapters and without LoRA, and
transformers (+ PEFT) static batches, all in one run on the same random-weight model.

    python3 benchmarks/throughput.py                 # shape S (Llama-3.2-1B), bf16
    python3 benchmarks/throughput.py --shape L       # Llama-3.1-8B
    python3 benchmarks/throughput.py --shape L qwen3-8b gemma3-12b --adapters 64 --skip-transformers \
        --load-format dummy     # three shapes one after the other, random weights made on the GPU
    python3 benchmarks/throughput.py --profile       # also: where one decode step's time goes
    python3 benchmarks/throughput.py --kv-cache-dtype fp8 --skip-transformers   # the engine, fp8 KV cache
    python3 benchmarks/throughput.py --quantization fp8 --skip-transformers     # bf16 and FP8 weights
    python3 benchmarks/throughput.py --smoke         # tiny shapes on the CPU (checks that it runs)
    python3 benchmarks/throughput.py --no-warmup-run --skip-transformers   # the first run after start-up
    python3 benchmarks/throughput.py --no-async-scheduling --skip-transformers --profile

Requests: prompts of uniform [128, 512] random tokens, exactly 128 output tokens, adapters assigned round
robin, all arriving at once (offline: TTFT includes queueing). transformers + PEFT with `adapter_names`
is slow (small GEMMs per adapter, projection and step), so it runs a subset, `--peft-requests` requests
(one static batch) for `--peft-tokens` output tokens; the table says so. transformers without LoRA runs
every request in static batches of `--hf-batch`.

`--quantization fp8` runs every engine condition twice in the same invocation, bf16 weights then FP8
weights (rows marked "fp8"), and compares them. The decode-step floor is the bytes one step must read, (base weights + the KV of every sequence + A and B
of each adapter in the step), over the device-to-device copy bandwidth measured in this run.
Imports: torch, transformers, peft, safetensors and this repo only.
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

# The repo root first: this folder's lora_kernels.py must not shadow the lora_kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from benchmarks.step_profile import profile_decode_steps  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

FP8_SUFFIX = " fp8"  # the name of a run with FP8 weights: its bf16 twin's name plus this


@dataclass
class StepRecord:
    seconds: float
    num_seqs: int
    kv_tokens: int  # keys read by this step's attention, summed over its sequences
    num_adapters: int  # distinct adapters in the step


@dataclass
class RunResult:
    name: str
    num_requests: int
    output_tokens: int
    seconds: float
    ttft: list[float]
    tpot: list[float]
    peak_bytes: int
    decode_steps: list[StepRecord] = field(default_factory=list)
    note: str = ""
    fp8_weights: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def steady_decode(self) -> list[StepRecord]:
        """Decode-only steps at the largest batch the run reached (the steady state of W1)."""
        if not self.decode_steps:
            return []
        top = max(s.num_seqs for s in self.decode_steps)
        return [s for s in self.decode_steps if s.num_seqs == top]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


# -- the engine -------------------------------------------------------------------------------------


# make_engine's options that the other benchmarks do not vary, at throughput.py's own defaults.
ENGINE_DEFAULTS = {
    "enforce_eager": False,
    "piecewise_cuda_graphs": False,
    "kv_cache_dtype": "auto",
    "fp8_gemm": "auto",
    "async_scheduling": True,
    "tensor_parallel_size": 1,
    "load_format": "auto",
    "max_vocab_loras": 0,
    "fused_allreduce": False,
}


def with_engine_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every option of ENGINE_DEFAULTS it does not set itself."""
    for name, value in ENGINE_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def make_engine(
    args, model_dir: Path, adapters: list[Path], max_len: int, quantization: str | None
) -> LLMEngine:
    blocks_per_seq = -(-max_len // 16)
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        block_size=16,
        num_kv_blocks=(args.max_num_seqs + 1) * blocks_per_seq,
        enable_prefix_caching=False,
        max_loras=max(1, len(adapters)),
        max_lora_rank=args.rank,
        enforce_eager=args.enforce_eager,
        piecewise_cuda_graphs=args.piecewise_cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype,
        async_scheduling=args.async_scheduling,
        quantization=quantization,
        fp8_gemm=args.fp8_gemm,
        tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format,
        max_vocab_loras=min(args.max_vocab_loras, max(1, len(adapters))),
        fused_allreduce=args.fused_allreduce,
    )
    engine = LLMEngine(config, skip_tokenizer_init=True)
    for i, path in enumerate(adapters):
        engine.register_adapter(f"a{i}", str(path))
    return engine


def drain(engine: LLMEngine, on_step=None) -> None:
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if on_step is not None:
            on_step(outputs)


def run_engine(
    args,
    name: str,
    model_dir: Path,
    adapters: list[Path],
    prompts: list[list[int]],
    max_len: int,
    quantization: str | None,
    warmup_prompts: list[list[int]],
):
    device = torch.device(args.device)
    w1.free_memory(device)
    started = time.perf_counter()
    engine = make_engine(args, model_dir, adapters, max_len, quantization)
    startup = time.perf_counter() - started  # weights, KV cache, graph capture, the engine's warm-up
    names = [f"a{i % len(adapters)}" if adapters else None for i in range(len(prompts))]
    # Warm-up run: requests like the measured ones (the same adapters, other prompts: w1_setup.Prompts),
    # once, unmeasured, so every adapter is resident before the clock starts. Kernel variants are the
    # engine's own start-up warm-up's job: the note column counts those compiled after it
    # (--no-warmup-run measures a first run straight after start-up).
    if not args.no_warmup_run:
        warm = SamplingParams(
            temperature=0.0, max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True
        )
        for i, (prompt, adapter) in enumerate(zip(warmup_prompts, names)):
            engine.add_request(f"warm{i}", prompt, warm, adapter)
        drain(engine)
    result = measure_run(args, engine, name, prompts, names, device)
    result.fp8_weights = quantization is not None
    notes = [
        f"start-up {startup:.1f} s",
        f"{engine.stats().num_kernel_compiles_after_ready} compiles after ready",
    ]
    if engine.runner.graphs is not None:
        notes.append(f"{engine.runner.graphs.num_replays} graph replays")
    result.note = "; ".join(notes)
    profile = None
    if args.profile and adapters and len(adapters) == max(args.adapters):
        profile = profile_decode_steps(engine, prompts, names, args.output_tokens, device)
    engine.shutdown()  # tensor-parallel workers leave before the next condition starts its own
    del engine
    w1.free_memory(device)
    return result, profile


def measure_run(args, engine: LLMEngine, name: str, prompts, names, device: torch.device) -> RunResult:
    """One W1 run on a built engine: every request at once, exactly `args.output_tokens` each; the
    decode-only steps' times recorded (the engine is left as it was)."""
    steps: list[StepRecord] = []
    execute = engine.runner.execute
    last_batch: list = []

    def recorded_execute(scheduled, in_flight=None):
        last_batch[:] = scheduled
        return execute(scheduled, in_flight)

    engine.runner.execute = recorded_execute
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True
    )
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    w1.sync(device)
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, names)):
        engine.add_request(str(i), prompt, params, adapter)
    while engine.has_unfinished_requests():
        last_batch.clear()
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if last_batch and all(s.num_new_tokens == 1 for s in last_batch):
            adapters_in_step = {s.request.adapter_id for s in last_batch} - {None}
            kv = sum(s.start + 1 for s in last_batch)
            steps.append(StepRecord(now - t0, len(last_batch), kv, len(adapters_in_step)))
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
    seconds = time.perf_counter() - start
    engine.runner.execute = execute
    n = args.output_tokens
    return RunResult(
        name,
        len(prompts),
        n * len(prompts),
        seconds,
        ttft=[first[r] - start for r in done],
        tpot=[(done[r] - first[r]) / (n - 1) for r in done],
        peak_bytes=w1.peak_bytes(device),
        decode_steps=steps,
    )


# -- transformers (+ PEFT) ----------------------------------------------------------------------------


def run_transformers(args, name, model_dir, adapters, prompts, output_tokens, batch_size, note):
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    device = torch.device(args.device)
    w1.free_memory(device)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    kwargs = {}
    if adapters:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="a0")
        for i, path in enumerate(adapters[1:], start=1):
            model.load_adapter(str(path), adapter_name=f"a{i}")
        model.eval()

    stamps: list[float] = []

    class Stamp(LogitsProcessor):  # called once per generated token, after that step's forward
        def __call__(self, input_ids, scores):
            w1.sync(device)
            stamps.append(time.perf_counter())
            return scores

    ttft, tpot, total = [], [], 0.0
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        if adapters:
            kwargs["adapter_names"] = [f"a{(b + i) % len(adapters)}" for i in range(len(batch))]
        stamps.clear()
        w1.sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_tokens,
                do_sample=False,
                min_new_tokens=output_tokens,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([Stamp()]),
                **kwargs,
            )
        w1.sync(device)
        total += time.perf_counter() - start
        ttft += [stamps[0] - start] * len(batch)
        tpot += [(stamps[-1] - stamps[0]) / max(1, output_tokens - 1)] * len(batch)
    result = RunResult(
        name, len(prompts), output_tokens * len(prompts), total, ttft, tpot, w1.peak_bytes(device), note=note
    )
    del model
    w1.free_memory(device)
    return result


# -- report -------------------------------------------------------------------------------------------


def step_floor(
    config,
    steps: list[StepRecord],
    rank: int,
    element: int,
    bandwidth: float,
    kv_element: int,
    fp8: bool,
    tp: int = 1,
) -> float:
    """The bytes one GPU's decode step must read (its shard with `tp` ranks) over `bandwidth`, averaged."""
    base = w1.base_weight_bytes(config, element, fp8, tp)
    per_token, per_adapter = (
        w1.kv_bytes_per_token(config, kv_element, tp),
        w1.adapter_bytes(config, rank, element, tp),
    )
    return statistics.mean(
        (base + s.kv_tokens * per_token + s.num_adapters * per_adapter) / bandwidth for s in steps
    )


def report(args, config, results: list[RunResult], bandwidth: float, element: int) -> str:
    lines = [
        f"W1, shape {args.shape}, {args.dtype}, {args.num_requests} requests, prompts [{args.min_prompt}, "
        f"{args.max_prompt}] tokens, {args.output_tokens} output tokens, rank {args.rank} over all "
        f"{len(w1.module_dims(config))} projections, {config.architectures[0]}, "
        f"{'random weights made on the device (load_format dummy)' if args.load_format == 'dummy' else 'weights read from a checkpoint'}, "
        f"KV cache {args.kv_cache_dtype}, FP8 GEMM {args.fp8_gemm}, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}; "
        f"copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s",
        "",
        "| run | requests | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | peak mem (GiB) "
        "| decode step (ms) @ batch | floor (ms) | step / floor | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    steady = {}
    for r in results:
        ms = [1e3 * percentile(v, q) for v in (r.ttft, r.tpot) for q in (50, 99)]
        steps = r.steady_decode()
        step_cells = "| - | - | -"
        if steps:
            step = statistics.median(s.seconds for s in steps)
            kv_element = 1 if args.kv_cache_dtype.startswith("fp8") else element
            floor = step_floor(
                config,
                steps,
                args.rank,
                element,
                bandwidth,
                kv_element,
                r.fp8_weights,
                args.tensor_parallel_size,
            )
            steady[r.name] = (step, floor)
            step_cells = f"| {1e3 * step:.2f} @ {steps[0].num_seqs} | {1e3 * floor:.2f} | {step / floor:.2f}"
        lines.append(
            f"| {r.name} | {r.num_requests} | {r.tokens_per_second:.0f} | {ms[0]:.0f} / {ms[1]:.0f} "
            f"| {ms[2]:.1f} / {ms[3]:.1f} | {r.peak_bytes / 2**30:.1f} {step_cells} | {r.note} |"
        )
    by_name = {r.name: r for r in results}
    top = f"engine N={max(args.adapters)}"
    lines.append("")
    for other in ("transformers+PEFT", "transformers (no LoRA)"):
        if top in by_name and other in by_name:
            ratio = by_name[top].tokens_per_second / by_name[other].tokens_per_second
            lines.append(f"- {top} / {other}: {ratio:.1f}x output tokens/s")
    if top in steady and "engine (no LoRA)" in steady:
        (t_lora, f_lora), (t_base, f_base) = steady[top], steady["engine (no LoRA)"]
        lines.append(
            f"- LoRA overhead at {top}: decode step {t_lora / t_base:.2f}x the no-LoRA step; the extra LoRA "
            f"bytes explain {f_lora / f_base:.2f}x; extra time / extra floor time = "
            f"{(t_lora - t_base) / max(f_lora - f_base, 1e-12):.2f}"
        )
    for r in results:
        bf16 = by_name.get(r.name.removesuffix(FP8_SUFFIX))
        if r.fp8_weights and bf16 is not None:
            cells = f"output tok/s {r.tokens_per_second / bf16.tokens_per_second:.2f}x"
            if r.name in steady and bf16.name in steady:
                cells += f", decode step {steady[r.name][0] / steady[bf16.name][0]:.2f}x"
            lines.append(f"- FP8 weights / bf16 at {bf16.name}: {cells}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shape",
        choices=[s for s in w1.ALL_SHAPES if "smoke" not in s],
        nargs="+",
        default=["S"],
        help="one or more shapes, run one after the other in this invocation (a table each)",
    )
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 16, 64], help="values of N")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--peft-requests", type=int, default=32)
    p.add_argument("--peft-tokens", type=int, default=32)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="the engine without CUDA graphs")
    p.add_argument(
        "--piecewise-cuda-graphs",
        action="store_true",
        help="mixed prefill/decode steps as piecewise CUDA graphs (the engine's default: eager)",
    )
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="the engine's KV cache")
    p.add_argument(
        "--quantization",
        choices=["fp8"],
        help="also run every engine condition with FP8 weights, after the bf16 ones (same invocation)",
    )
    p.add_argument(
        "--fp8-gemm", choices=["auto", "scaled_mm", "dequant"], default="auto", help="the FP8 weights' GEMM"
    )
    p.add_argument("--profile", action="store_true", help="break a decode step of the largest N down")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and launch each step before reading the previous step's tokens (the engine's "
        "default; --no-async-scheduling: one step at a time)",
    )
    p.add_argument(
        "--no-warmup-run",
        action="store_true",
        help="measure the first run after start-up (adapters load and anything compiled counts)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the engine's model split over this many GPUs (peak memory is rank 0's; the floor is per GPU); "
        "benchmarks/tensor_parallel.py compares several sizes in one invocation",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: the engine draws random weights on the device (no checkpoint written or read; "
        "needs --skip-transformers)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    p.add_argument("--smoke-shapes", nargs="+", default=["smoke"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device, args.dtype = "cuda", "bfloat16"
    if args.smoke:
        args.shape, args.device, args.dtype = args.smoke_shapes, "cpu", "float32"
        args.adapters, args.num_requests, args.min_prompt, args.max_prompt = [1, 2], 6, 8, 24
        args.output_tokens, args.max_num_seqs, args.max_num_batched_tokens = 4, 4, 64
        args.peft_requests, args.peft_tokens, args.hf_batch = 2, 3, 4
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    if args.load_format == "dummy" and not args.skip_transformers:
        p.error("--load-format dummy writes no checkpoint for transformers: add --skip-transformers")
    return with_engine_defaults(args)


def main(argv=None) -> None:
    args = parse_args(argv)
    for shape in args.shape:
        run_shape(argparse.Namespace(**{**vars(args), "shape": shape}))


def run_shape(args) -> None:
    """Every condition on one shape, then its table."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rng = random.Random(0)
    config = w1.llama_config(args.shape)
    prompt_sets = w1.prompt_sets(rng, config.vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
    prompts = prompt_sets.measured
    max_len = args.max_prompt + args.output_tokens
    element = torch.tensor([], dtype=dtype).element_size()
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.load_format != "dummy"
        model_dir = w1.make_model(Path(tmp) / "model", args.shape, dtype, device, weights)
        adapters = w1.make_adapters(Path(tmp), model_dir, config, max(args.adapters), args.rank, dtype)
        bandwidth = w1.copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
        results, profiles = [], []
        for quantization in [None, *([args.quantization] if args.quantization else [])]:
            for n in [0, *args.adapters]:
                name = (f"engine N={n}" if n else "engine (no LoRA)") + (FP8_SUFFIX if quantization else "")
                result, prof = run_engine(
                    args, name, model_dir, adapters[:n], prompts, max_len, quantization, prompt_sets.warm_up
                )
                results.append(result)
                if prof:
                    profiles.append(f"{name}:\n{prof}")
                print(f"{name}: {result.tokens_per_second:.0f} output tokens/s", flush=True)
        if not args.skip_transformers:
            n = max(args.adapters)
            peft_note = f"first {args.peft_requests} requests, {args.peft_tokens} output tokens, N={n}"
            results.append(
                run_transformers(
                    args,
                    "transformers+PEFT",
                    model_dir,
                    adapters[:n],
                    prompts[: args.peft_requests],
                    args.peft_tokens,
                    args.peft_requests,
                    peft_note,
                )
            )
            results.append(
                run_transformers(
                    args,
                    "transformers (no LoRA)",
                    model_dir,
                    [],
                    prompts,
                    args.output_tokens,
                    args.hf_batch,
                    f"static batches of {args.hf_batch}",
                )
            )
    print()
    print(report(args, config, results, bandwidth, element))
    for profile in profiles:
        print()
        print(profile)


if __name__ == "__main__":
    main()
