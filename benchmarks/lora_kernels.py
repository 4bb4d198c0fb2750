"""Grouped-LoRA kernel benchmark (issue 6): decode and prefill shapes, CUDA-graph replays with a cold L2.

    python benchmarks/lora_kernels.py              # on a CUDA machine; prints a markdown table
    python benchmarks/lora_kernels.py --dry-run    # anywhere: tiny shapes under TRITON_INTERPRET, CPU timers

Needs only torch, triton and this repository (put on sys.path here). How it measures:
- Each op runs on K input sets (x, y, A, B) whose bytes together exceed twice the L2, captured as K ops in
  one CUDA graph; the per-op time is the replay time / K, median over replays. Each op thus starts with
  its data out of L2, as in a real forward pass, without paying a flush kernel per measurement.
- Floor: the bytes an op cannot avoid (A and B of the adapters the batch uses, x once, y read and
  written) over the device-to-device copy bandwidth measured in the same run (read + write bytes / time).
- Naive: `lora_kernels.reference` (a torch loop over the adapters present, eager, it syncs); base: the
  bf16 linear `x @ W^T` of the same shape, graphed like ours.
- Decode batches assign adapters round-robin then shuffle (64 tokens over 64 adapters: every token its
  own adapter); prefill batches give each adapter a contiguous run of tokens, as requests arrive.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Shape:
    name: str
    num_tokens: int
    num_adapters: int
    in_features: int
    out_slices: tuple[int, ...]
    rank: int = 16

    def small(self) -> Shape:
        """The dry-run version: same structure, interpreter-sized."""
        return Shape(
            self.name,
            min(self.num_tokens, 8),
            min(self.num_adapters, 4),
            64,
            tuple(max(16, w // 128) for w in self.out_slices),
            self.rank,
        )


SHAPES = [
    Shape("decode", 64, 64, 4096, (4096,)),
    Shape("decode", 64, 64, 4096, (14336,)),
    Shape("decode", 256, 64, 4096, (4096,)),
    Shape("decode", 256, 64, 4096, (14336,)),
    Shape("decode qkv", 64, 64, 4096, (4096, 1024, 1024)),
    Shape("prefill", 4096, 16, 4096, (4096,)),
    Shape("prefill", 4096, 16, 4096, (14336,)),
]
# (label, add_lora keywords, environment) of the variants timed; "auto" is what the engine gets.
VARIANTS = [
    ("auto", {}, {}),
    ("gathered", {"path": "gathered"}, {}),
    ("segmented", {"path": "segmented"}, {}),
    ("auto, PDL off", {}, {"LORA_KERNELS_PDL": "0"}),
]


def token_slots_for(shape: Shape, gen: torch.Generator) -> torch.Tensor:
    t, n = shape.num_tokens, shape.num_adapters
    if shape.name.startswith("prefill"):
        return (torch.arange(t) * n // t).to(torch.int32)
    return (torch.arange(t) % n)[torch.randperm(t, generator=gen)].to(torch.int32)


@dataclass
class InputSet:
    x: torch.Tensor  # [num_tokens, in]
    y: torch.Tensor  # [num_tokens, sum(out_slices)]
    lora_as: list[torch.Tensor]  # slices x [num_adapters, rank, in]
    lora_bs: list[torch.Tensor]  # slices x [num_adapters, out_slice, rank]
    scales: list[torch.Tensor]  # slices x [num_adapters] float32
    token_slots: torch.Tensor  # [num_tokens] int32
    weight: torch.Tensor  # [sum(out_slices), in], the base linear


def make_set(shape: Shape, seed: int, device: str, dtype: torch.dtype = torch.bfloat16) -> InputSet:
    gen = torch.Generator().manual_seed(seed)
    s, r, k = shape.num_adapters, shape.rank, shape.in_features

    def rand(*size: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * std).to(device=device, dtype=dtype)

    return InputSet(
        x=rand(shape.num_tokens, k),
        y=rand(shape.num_tokens, sum(shape.out_slices)),
        lora_as=[rand(s, r, k, std=k**-0.5) for _ in shape.out_slices],
        lora_bs=[rand(s, w, r, std=r**-0.5) for w in shape.out_slices],
        scales=[torch.full((s,), 2.0, device=device) for _ in shape.out_slices],
        token_slots=token_slots_for(shape, gen).to(device),
        weight=rand(sum(shape.out_slices), k, std=k**-0.5),
    )


def floor_bytes(shape: Shape, used_adapters: int, elem: int = 2) -> int:
    """Bytes no implementation can avoid: used A and B rows, x read once, y read and written."""
    per_adapter = shape.rank * elem * (shape.in_features * len(shape.out_slices) + sum(shape.out_slices))
    return used_adapters * per_adapter + shape.num_tokens * elem * (
        shape.in_features + 2 * sum(shape.out_slices)
    )


class Timer:
    """Per-op microseconds: CUDA-graph replays on a GPU, one plain call per op under --dry-run."""

    def __init__(self, dry_run: bool, reps: int):
        self.dry_run, self.reps = dry_run, reps

    def graph(self, ops: list) -> float:
        if self.dry_run:
            return self.eager(ops)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for op in ops:  # compile and warm up outside the capture
                op()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for op in ops:
                op()
        return self._events(graph.replay, self.reps) / len(ops)

    def eager(self, ops: list, reps: int = 3) -> float:
        def run_all() -> None:
            for op in ops:
                op()

        if self.dry_run:
            start = time.perf_counter()
            run_all()
            return (time.perf_counter() - start) * 1e6 / len(ops)
        run_all()
        return self._events(run_all, reps) / len(ops)

    @staticmethod
    def _events(fn, reps: int) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # queue everything behind a busy GPU: no host gaps in the timings
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in pairs) * 1e3


def copy_bandwidth(timer: Timer, device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    numel = (256 << 20) if not timer.dry_run else (16 << 20)
    src, dst = (
        torch.empty(numel, dtype=torch.uint8, device=device),
        torch.empty(numel, dtype=torch.uint8, device=device),
    )
    micros = timer.eager([lambda: dst.copy_(src)], reps=20)
    return 2 * numel / (micros * 1e-6)


def run_shape(shape: Shape, timer: Timer, bandwidth: float, l2_bytes: int, device: str) -> list[dict]:
    import lora_kernels
    from lora_kernels import reference, tiles
    from lora_kernels.expand_kernels import launch_expand
    from lora_kernels.shrink_kernels import launch_shrink

    slots = token_slots_for(shape, torch.Generator().manual_seed(0))
    used = int(torch.unique(slots).numel())  # every set permutes the same assignment
    need = floor_bytes(shape, used)
    num_sets = min(32, max(2, math.ceil(2 * l2_bytes / need)))
    sets = [make_set(shape, seed, device) for seed in range(num_sets)]
    metas = [lora_kernels.LoRABatchMeta.build(s.token_slots, shape.num_adapters) for s in sets]
    slices = list(shape.out_slices)

    def add(s: InputSet, meta, **kw):
        return lambda: lora_kernels.add_lora_multi(
            s.y, s.x, s.lora_as, s.lora_bs, s.token_slots, s.scales, slices, meta=meta, backend="triton", **kw
        )

    naive = timer.eager(
        [
            lambda s=s: reference.add_lora_multi(
                s.y, s.x, s.lora_as, s.lora_bs, s.token_slots, s.scales, slices
            )
            for s in sets[:4]
        ]
    )
    base_sets = sets[: max(2, math.ceil(2 * l2_bytes / (sets[0].weight.numel() * 2)))]
    outs = [torch.empty_like(s.y) for s in base_sets]
    base = timer.graph(
        [lambda s=s, o=o: torch.matmul(s.x, s.weight.T, out=o) for s, o in zip(base_sets, outs)]
    )

    rows = []
    for label, kw, env in VARIANTS:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            s0 = sets[0]
            y_before = s0.y.clone()
            add(s0, metas[0], **kw)()
            expected = reference.add_lora_multi(
                y_before.double(),
                s0.x.double(),
                [a.double() for a in s0.lora_as],
                [b.double() for b in s0.lora_bs],
                s0.token_slots,
                [c.double() for c in s0.scales],
                slices,
            )
            err = ((s0.y.double() - expected).abs().max() / expected.abs().max()).item()
            micros = timer.graph([add(s, m, **kw) for s, m in zip(sets, metas)])
            path = kw.get("path") or tiles.choose_path(shape.num_tokens)
            split = {}
            if label == "auto":
                split = time_split(shape, sets, metas, path, timer, launch_shrink, launch_expand, tiles)
                path += f", split-K {split.pop('split_k')}"
            rows.append(dict(label=label, path=path, us=micros, err=err, **split))
        except Exception as exc:  # report the failure in the table and keep going
            rows.append(dict(label=label, path="-", us=float("nan"), err=float("nan"), error=repr(exc)[:80]))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    for row in rows:
        row.update(shape=shape, used=used, need=need, floor_us=need / bandwidth * 1e6, naive=naive, base=base)
    return rows


def time_split(shape, sets, metas, path, timer, launch_shrink, launch_expand, tiles) -> dict:
    """Shrink alone and expand alone, through the same launchers add_lora uses."""
    s0 = sets[0]
    rows, bm = (s0.x.shape[0], 0) if path == "gathered" else (metas[0].num_tiles, metas[0].block_m)
    sconf = tiles.shrink_config(
        path, rows, len(s0.lora_as), shape.in_features, shape.rank, s0.x.dtype, s0.x.device, bm
    )
    econf = tiles.expand_config(path, shape.rank, s0.x.dtype, s0.x.device, bm)
    hs = [
        torch.zeros(sconf.split_k, len(s.lora_as), shape.num_tokens, shape.rank, device=s.x.device)
        for s in sets
    ]
    shrink_ops = [
        lambda s=s, m=m, h=h: launch_shrink(h, s.x, s.lora_as, s.token_slots, None, m, path, sconf)
        for s, m, h in zip(sets, metas, hs)
    ]
    expand_ops = [
        lambda s=s, m=m, h=h: launch_expand(
            s.y, h, s.lora_bs, s.scales, s.token_slots, None, list(shape.out_slices), m, path, econf
        )
        for s, m, h in zip(sets, metas, hs)
    ]
    return dict(shrink_us=timer.graph(shrink_ops), expand_us=timer.graph(expand_ops), split_k=sconf.split_k)


def print_table(rows: list[dict], bandwidth: float) -> None:
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)\n")
    print(
        "| shape | tokens | in -> out | adapters used | variant | path | µs | shrink µs | expand µs | GB/s "
        "| × floor | floor µs | naive µs | × faster than naive | base linear µs | LoRA / base | max rel err |"
    )
    print("|" + "---|" * 17)
    for r in rows:
        s = r["shape"]
        fmt = lambda v, spec=".1f": "-" if v is None or v != v else format(v, spec)  # noqa: E731
        print(
            f"| {s.name} | {s.num_tokens} | {s.in_features} -> {'+'.join(map(str, s.out_slices))} | {r['used']} "
            f"| {r['label']} | {r['path']} | {fmt(r['us'])} | {fmt(r.get('shrink_us'))} | {fmt(r.get('expand_us'))} "
            f"| {fmt(r['need'] / (r['us'] * 1e-6) / 1e9, '.0f')} | {fmt(r['us'] / r['floor_us'], '.2f')} "
            f"| {fmt(r['floor_us'])} | {fmt(r['naive'], '.0f')} | {fmt(r['naive'] / r['us'], '.0f')} "
            f"| {fmt(r['base'])} | {fmt(r['us'] / r['base'], '.2f')} | {fmt(r['err'], '.1e')} |"
            + (f" {r['error']}" if "error" in r else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET"
    )
    parser.add_argument("--reps", type=int, default=50, help="graph replays per measurement")
    parser.add_argument("--only", default="", help="run only shapes whose name contains this")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before lora_kernels imports triton
    elif not torch.cuda.is_available():
        print(
            "no CUDA device: nothing to benchmark (python benchmarks/lora_kernels.py --dry-run checks the script)"
        )
        return 0
    import triton

    device = "cpu" if args.dry_run else "cuda"
    timer = Timer(args.dry_run, args.reps)
    l2 = 0 if args.dry_run else torch.cuda.get_device_properties(0).L2_cache_size
    name = (
        "CPU (dry run: interpreter timings mean nothing)" if args.dry_run else torch.cuda.get_device_name(0)
    )
    print(f"{name}; torch {torch.__version__}, triton {triton.__version__}, L2 {l2 >> 20} MiB")
    bandwidth = copy_bandwidth(timer, device)
    rows = []
    for shape in SHAPES:
        if args.only in shape.name:
            rows += run_shape(shape.small() if args.dry_run else shape, timer, bandwidth, l2, device)
    print_table(rows, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
