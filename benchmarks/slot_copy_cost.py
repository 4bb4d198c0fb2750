"""Where a slot copy's cost to the running decode batch comes from (a diagnostic for issue 3).

    python3 benchmarks/slot_copy_cost.py                      # on a CUDA machine
    python3 benchmarks/slot_copy_cost.py --trace-dir DIR      # also torch.profiler traces of two conditions
    python3 benchmarks/slot_copy_cost.py --smoke              # anywhere: tiny shapes on the CPU

The decode batch of `adapter_loading.py` (a Llama-3.2-1B-shaped model with a few layers, 48 running
requests over 8 adapters) steps while requests for other adapters queue behind it; their adapters wait in
the CPU tier, so each one only needs its copy into a GPU slot (about one a step). The copy is replaced per
condition, everything else staying the same:
- control: the same request traffic for adapters already resident (nothing is copied)
- as built: `stage` picks the slot before the step; `start_copies` issues the two copies (the slot's
  weights, and its column of the scale/rank table) on a side stream once the forward pass is launched
- issued before the launch: the same copies issued inside `stage`, before the step's forward pass (the
  design until 2026-11-23)
- no copy: as built, with the copies themselves left out (events and admission only)
- no CUDA calls: the slot bookkeeping alone, no copy, event or stream call (ready at once)
Per condition: the median and p99 step wall time, the GPU time between the step's first and last event
on the compute stream, and the engine thread's time per phase of the step: the manager before the launch
(poll, stage, the scheduler's is_ready), scheduling, the runner (inputs and launch), start_copies, and
sampling (which waits for the GPU).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapter_loading import (  # noqa: E402
    Background,
    adapter_folders,
    add_decode_arguments,
    decode_engine,
    decode_model,
    ms,
    paired_ratios,
)

VARIANTS = ("control", "as built", "issued before the launch", "no copy", "no CUDA calls")
# Parts of LLMEngine.step timed on the engine thread (manager: poll, stage and is_ready).
PHASES = ("manager", "schedule", "execute", "start_copies", "sample")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    add_decode_arguments(parser, rounds=8)
    parser.add_argument("--copy-adapters", type=int, default=24, help="adapters cycled through the slots")
    parser.add_argument("--concurrent", type=int, default=4, help="queued requests for them at once")
    parser.add_argument("--trace-dir", type=Path, default=None, help="write profiler traces here (CUDA only)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.batch_adapters, args.copy_adapters, args.max_loras = 8, 2, 6, 4
        args.decode_layers, args.prompt_len, args.rounds, args.block_steps, args.settle_steps = 2, 8, 2, 4, 2
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("no CUDA device: run on a GPU machine, or pass --smoke")
    with tempfile.TemporaryDirectory(prefix="slot-copy-") as tmp:
        rows = run(args, device, Path(tmp))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n- **Device**: {name}; torch {torch.__version__}")
    print(f"- **Command**: `python3 {' '.join(['benchmarks/slot_copy_cost.py', *(argv or sys.argv[1:])])}`\n")
    print(
        "| condition | steps | median step ms | p99 ms | vs control, by round: median [IQR] | GPU stream ms "
        "| copies/step |\n|---|---|---|---|---|---|---|"
    )
    for label, times, _, gpu, per_step in rows:
        mid, q1, q3 = paired_ratios(times, rows[0][1], args.block_steps)
        print(
            f"| {label} | {len(times)} | **{ms(times):.3f}** | {ms(times, 0.99):.3f} | **{mid:.3f}** "
            f"[{q1:.3f}, {q3:.3f}] | {ms(gpu) if gpu else float('nan'):.3f} | {per_step:.2f} |"
        )
    print(f"\nThe engine thread's median ms per step in each phase:\n\n| condition | {' | '.join(PHASES)} |")
    print(f"|---|{'---|' * len(PHASES)}")
    for label, _, phase, _, _ in rows:
        print(f"| {label} | {' | '.join(f'{ms(phase[name]):.3f}' for name in PHASES)} |")
    print()
    control = statistics.median(rows[0][1])
    for label, times, _, _, per_step in rows[1:]:
        if per_step:
            print(f"- {label}: {(statistics.median(times) - control) / per_step * 1e3:.3f} ms per copy")
    return 0


def run(args, device: torch.device, root: Path) -> list[tuple]:
    sizes, model_dir, shape = decode_model(args, device, root)
    batch_ids = adapter_folders(root, shape, "batch", 100, args.batch_adapters)
    copy_ids = adapter_folders(root, shape, "cpu", 300, args.copy_adapters)
    rounds_steps = args.rounds * len(VARIANTS) * (args.block_steps + args.settle_steps)
    max_tokens = rounds_steps + 64 + (60 if args.trace_dir else 0)
    events = Counter()
    engine = decode_engine(
        args,
        device,
        model_dir,
        sizes,
        batch_ids,
        copy_ids,
        max_tokens,
        max_cpu_loras=len(batch_ids) + len(copy_ids) + 2,
        adapter_loader="thread",
        observer=lambda e, t, s: events.update([(e, t)]),
    )
    lora = engine.lora
    own_stage, own_start, own_load = lora.stage, lora.start_copies, lora.slots.load
    own_stream, own_copy_into = lora._copy_stream, lora._copy_into
    condition = ["control"]

    def stage(wanted):
        own_stage(wanted)
        if condition[0] == "issued before the launch":
            own_start()

    # The engine thread's time per phase of a step (the manager's before the launch includes the
    # scheduler's is_ready calls, which the schedule phase also counts).
    phases = {name: [0.0] for name in PHASES}
    lora.poll, lora.stage = _timed(lora.poll, phases["manager"]), _timed(stage, phases["manager"])
    engine.scheduler.adapter_ready = _timed(lora.is_ready, phases["manager"])
    engine.scheduler.schedule = _timed(engine.scheduler.schedule, phases["schedule"])
    engine.runner.execute = _timed(engine.runner.execute, phases["execute"])
    lora.start_copies = _timed(own_start, phases["start_copies"])
    sampler = engine.sampler
    engine.sampler = _timed(sampler, phases["sample"])
    engine.sampler.free = sampler.free
    for _ in range(10):
        engine.step()

    cuda = device.type == "cuda"
    times = {label: [] for label in VARIANTS}
    phase_ms = {label: {name: [] for name in PHASES} for label in VARIANTS}
    gpu_ms = {label: [] for label in VARIANTS}
    copies: Counter[str] = Counter()
    order, rng = list(VARIANTS), random.Random(0)  # shuffled per round: later blocks run longer contexts
    for _ in range(args.rounds):
        rng.shuffle(order)
        for label in order:
            condition[0] = label
            lora.slots.load = (lambda slot, image, pages: None) if label == "no copy" else own_load
            lora._copy_stream, lora._copy_into = (
                (_NoStream() if cuda else None, lambda slot, row: None)
                if label == "no CUDA calls"
                else (own_stream, own_copy_into)
            )
            background = Background(engine, batch_ids if label == "control" else copy_ids, args.concurrent)
            for i in range(args.settle_steps + args.block_steps):
                background.before_step()
                if i == args.settle_steps:
                    events.clear()
                if cuda:
                    torch.cuda.synchronize(device)
                    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    first.record()
                for total in phases.values():
                    total[0] = 0.0
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
                if cuda:
                    last.record()
                    last.synchronize()
                if i >= args.settle_steps:
                    times[label].append(elapsed)
                    for name, total in phases.items():
                        phase_ms[label][name].append(total[0])
                    if cuda:
                        gpu_ms[label].append(first.elapsed_time(last) / 1e3)
                assert engine.scheduler.num_running == args.batch, "the measured batch must stay the same"
            copies[label] += events[("load", "cpu")]
            background.stop()
    condition[0], lora.slots.load = "as built", own_load
    lora._copy_stream, lora._copy_into = own_stream, own_copy_into
    if args.trace_dir is not None and cuda:
        trace(engine, batch_ids, copy_ids, args, device)
    engine.shutdown()
    return [
        (label, times[label], phase_ms[label], gpu_ms[label], copies[label] / len(times[label]))
        for label in VARIANTS
    ]


def trace(engine, batch_ids, copy_ids, args, device) -> None:
    """Chrome traces and op tables of 20 steps of the control and of copies as built."""
    from torch.profiler import ProfilerActivity, profile

    args.trace_dir.mkdir(parents=True, exist_ok=True)
    for label, ids in (("control", batch_ids), ("copies", copy_ids)):
        background = Background(engine, ids, args.concurrent)
        for _ in range(10):
            background.before_step()
            engine.step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                background.before_step()
                engine.step()
            torch.cuda.synchronize(device)
        background.stop()
        prof.export_chrome_trace(str(args.trace_dir / f"trace-{label}.json"))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        (args.trace_dir / f"ops-{label}.txt").write_text(table)
        print(f"\n## {label}: ops by self CPU time over 20 steps\n\n{table}")


class _NoStream:
    def wait_stream(self, stream) -> None:
        pass


def _timed(fn, total: list[float]):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started

    return wrapper


if __name__ == "__main__":
    sys.exit(main())
