"""Where one decode step's time goes: torch.profiler kernel times grouped by kind, and the rest of the
step's wall time (GPU idle: Python, scheduling, host-device copies). Used by throughput.py --profile and
by tensor_parallel.py (its NCCL kinds: the all-reduces of row-parallel projections, the logits all-gather,
the broadcast of each step's inputs; kernels inside CUDA-graph replays are traced too). Under tensor
parallelism this is rank 0's GPU, and a collective's time includes waiting for the slowest rank."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.sampling_params import SamplingParams

# Kernel name fragments per kind, checked in order (the first match wins).
KINDS = [
    ("fused all-reduce + norm", ("_allreduce_add_norm_kernel",)),  # engine/parallel/fused_allreduce.py
    ("attention", ("paged_attention", "combine_splits", "index_copy", "flash", "attention")),
    ("LoRA", ("shrink", "expand")),
    ("GEMMs", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "matmul")),
    ("fused norms, RoPE, SiLU", ("_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel")),
    ("sampling", ("argmax", "softmax", "sort", "topk", "exponential", "log_softmax", "max_kernel")),
]


NCCL_KINDS = (
    ("allreduce", "NCCL all-reduce"),
    ("allgather", "NCCL all-gather"),
    ("broadcast", "NCCL broadcast"),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    if "nccl" in name:
        return next((kind for fragment, kind in NCCL_KINDS if fragment in name), "NCCL other")
    for kind, fragments in KINDS:
        if any(f in name for f in fragments):
            return kind
    return "other kernels (norms, RoPE, elementwise)"


def profile_decode_steps(
    engine, prompts, names, output_tokens: int, device: torch.device, steps: int = 8
) -> str:
    """Fill the engine's batch with requests, wait until every one decodes, then profile `steps` steps;
    a table of where the time goes."""
    batch, wall, per_kind = decode_step_times(engine, prompts, names, output_tokens, device, steps)
    lines = [
        f"Decode step breakdown: batch {batch}, {steps} steps, {wall * 1e3:.2f} ms per step"
        + ("" if device.type == "cuda" else " (CPU: kernel times unavailable)"),
        "",
        "| part | ms per step | share |",
        "|---|---|---|",
    ]
    for kind, seconds in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {seconds * 1e3:.3f} | {seconds / wall:.0%} |")
    return "\n".join(lines)


def decode_step_times(
    engine, prompts, names, output_tokens: int, device: torch.device, steps: int = 8
) -> tuple[int, float, dict[str, float]]:
    """(batch, wall seconds per step, {kind: kernel seconds per step}) of `steps` profiled decode steps."""
    batch = min(engine.config.max_num_seqs, len(prompts))
    params = SamplingParams(
        temperature=0.0, max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True
    )
    ids = [f"profile{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, prompts[i], params, names[i])
    for _ in range(output_tokens // 2):  # prefill everything (chunks included) before measuring
        engine.step()
        if not engine.scheduler.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running
        ):
            break
    engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) / steps
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()

    per_kind: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kind_of(event.key)
        per_kind[kind] = per_kind.get(kind, 0.0) + event.self_device_time_total / 1e6 / steps
    kernels = sum(per_kind.values())
    per_kind["GPU idle (Python, scheduling, copies, launch gaps)"] = max(0.0, wall - kernels)
    return batch, wall, per_kind
