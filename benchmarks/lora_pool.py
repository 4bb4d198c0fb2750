"""The paged adapter pool against the old slot layout, kernel level (issue 19): time and memory.

    TRITON_INTERPRET=0 python benchmarks/lora_pool.py            # on a CUDA machine; a markdown table
    python benchmarks/lora_pool.py --dry-run                     # anywhere: tiny shapes, interpreter

For each shape and rank mix, the same adapters are applied two ways, graphed and timed as in
benchmarks/lora_kernels.py (K input sets over twice the L2, CUDA-graph replays, per-op median):
- slots: the old layout, one `[num_adapters, max_lora_rank, in]` stack per projection, every adapter
  max_lora_rank wide (zero past its rank, which the kernels skip with `slot_ranks`); `add_lora_multi`;
- pool: pages of 8 rank rows, each adapter holding ceil(rank / 8) consecutive pages (as the allocator
  gives them), or scattered pages (a shuffled page order: the worst case after churn); `add_lora_paged`.
- model-wide (uniform 16 only): both layouts as the engine holds them, where one slot (old) or one page
  (now) spans every layer and projection of Llama-3.1-8B, so slots or pages lie tens of MB apart and
  the op touches as many distant memory regions as in a forward pass (address translation included).
Rank mixes: uniform 16 (max_lora_rank 16, the common case: the pool must cost nothing there) and
8/16/64 in turn (max_lora_rank 64). "weights MiB" is what each layout allocates for those adapters
(model-wide: the slices timed, not the whole model).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_kernels import SHAPES, Shape, Timer, token_slots_for  # noqa: E402

PAGE = 8
MIXES = {"uniform 16": ([16], 16), "mixed 8/16/64": ([8, 16, 64], 64)}
LAYOUTS = ("slots", "pool", "pool, scattered pages", "slots, model-wide", "pool, model-wide pages")
MODEL_WIDE_MIXES = ("uniform 16",)  # at max rank 64, 64 model-wide slots would take 21 GiB per input set
# Elements of one rank row over every layer and projection of Llama-3.1-8B (32 layers; A: 6 x 4096 +
# 14336, B: 3 x 4096 + 2 x 1024 + 2 x 14336): the engine's slot and page strides are multiples of it.
MODEL_ROW_NUMEL = 32 * (6 * 4096 + 14336 + 3 * 4096 + 2 * 1024 + 2 * 14336)


def ranks_of(mix: str, num_adapters: int) -> tuple[list[int], int]:
    cycle, max_rank = MIXES[mix]
    return [cycle[i % len(cycle)] for i in range(num_adapters)], max_rank


def model_wide(stacks: list[torch.Tensor], row_numel: int) -> list[torch.Tensor]:
    """The same stacks ([units, rows, cols] each) as views into one tensor whose units (slots or pages)
    are `rows * row_numel` elements apart, the way the engine lays a whole model into each."""
    units, rows = stacks[0].shape[:2]
    sizes = [t[0].numel() for t in stacks]
    if sum(sizes) > rows * row_numel:
        raise ValueError("the stacks do not fit in a model-wide unit")
    big = torch.zeros(units, rows * row_numel, dtype=stacks[0].dtype, device=stacks[0].device)
    views, offset = [], 0
    for t, size in zip(stacks, sizes):
        view = big[:, offset : offset + size].view(t.shape)
        view.copy_(t)
        views.append(view)
        offset += size
    return views


def make_layouts(shape: Shape, ranks: list[int], max_rank: int, seed: int, device: str, layout: str):
    """(dense kwargs, paged kwargs, x, y, token_slots, scales) for one input set."""
    scattered = "scattered" in layout
    gen = torch.Generator().manual_seed(seed)
    n, k, dtype = len(ranks), shape.in_features, torch.bfloat16
    max_pages = -(-max_rank // PAGE)
    pages_of = [-(-r // PAGE) for r in ranks]
    order = list(range(sum(pages_of)))
    if scattered:
        order = torch.randperm(len(order), generator=gen).tolist()
    page_table = torch.zeros(n, max_pages, dtype=torch.int32)
    dense_as = [torch.zeros(n, max_rank, k, dtype=dtype) for _ in shape.out_slices]
    dense_bs = [torch.zeros(n, w, max_rank, dtype=dtype) for w in shape.out_slices]
    pool_as = [torch.zeros(len(order), PAGE, k, dtype=dtype) for _ in shape.out_slices]
    pool_bs = [torch.zeros(len(order), w, PAGE, dtype=dtype) for w in shape.out_slices]
    next_page = 0
    for slot, rank in enumerate(ranks):
        pages = order[next_page : next_page + pages_of[slot]]
        next_page += pages_of[slot]
        page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for i, w in enumerate(shape.out_slices):
            a = (torch.randn(rank, k, generator=gen) * k**-0.5).to(dtype)
            bt = (torch.randn(rank, w, generator=gen) * rank**-0.5).to(dtype)
            dense_as[i][slot, :rank], dense_bs[i][slot, :, :rank] = a, bt.T
            padded_a = torch.zeros(len(pages) * PAGE, k, dtype=dtype)
            padded_b = torch.zeros(w, len(pages) * PAGE, dtype=dtype)
            padded_a[:rank], padded_b[:, :rank] = a, bt.T
            pool_as[i][pages] = padded_a.view(len(pages), PAGE, k)
            pool_bs[i][pages] = padded_b.view(w, len(pages), PAGE).transpose(0, 1)
    slots = token_slots_for(shape, gen).to(device)
    scales = [torch.full((n,), 2.0, device=device) for _ in shape.out_slices]
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=device)
    x = torch.randn(shape.num_tokens, k, generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(shape.num_tokens, sum(shape.out_slices), generator=gen).to(device=device, dtype=dtype)

    def dev(ts):
        return [t.to(device) for t in ts]

    dense = dict(lora_as=dev(dense_as), lora_bs=dev(dense_bs))
    paged = dict(pool_as=dev(pool_as), pool_bs=dev(pool_bs), page_table=page_table.to(device))
    if "model-wide" in layout:
        # A tiny row under --dry-run: the point there is the strides, not the memory.
        row_numel = (
            MODEL_ROW_NUMEL if device == "cuda" else len(shape.out_slices) * k + sum(shape.out_slices) + 64
        )
        if layout.startswith("slots"):
            views = model_wide(dense["lora_as"] + dense["lora_bs"], row_numel)
            dense = dict(lora_as=views[: len(dense_as)], lora_bs=views[len(dense_as) :])
        else:
            views = model_wide(paged["pool_as"] + paged["pool_bs"], row_numel)
            paged.update(pool_as=views[: len(pool_as)], pool_bs=views[len(pool_as) :])
    return dense, paged, x, y, slots, scales, ranks_t


def weights_mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def run(shape: Shape, mix: str, timer: Timer, l2: int, device: str) -> list[dict]:
    import lora_kernels

    ranks, max_rank = ranks_of(mix, shape.num_adapters)
    slices = list(shape.out_slices)
    per_set = sum(ranks) * 2 * (shape.in_features * len(slices) + sum(slices))
    num_sets = min(32, max(2, math.ceil(2 * l2 / per_set)))
    rows = []
    for layout in LAYOUTS:
        if "model-wide" in layout and mix not in MODEL_WIDE_MIXES:
            continue
        sets = [make_layouts(shape, ranks, max_rank, seed, device, layout) for seed in range(num_sets)]
        metas = [lora_kernels.LoRABatchMeta.build(s[4], shape.num_adapters) for s in sets]

        def op(s, meta, out=None, layout=layout):
            dense, paged, x, y, slots, scales, ranks_t = s
            y = y if out is None else out
            if layout.startswith("slots"):
                return lambda: lora_kernels.add_lora_multi(
                    y,
                    x,
                    dense["lora_as"],
                    dense["lora_bs"],
                    slots,
                    scales,
                    slices,
                    slot_ranks=ranks_t,
                    meta=meta,
                )
            return lambda: lora_kernels.add_lora_paged(
                y,
                x,
                paged["pool_as"],
                paged["pool_bs"],
                paged["page_table"],
                slots,
                scales,
                slices,
                ranks_t,
                meta=meta,
            )

        dense, paged, x, y, slots, scales, ranks_t = sets[0]
        out = y.clone()
        op(sets[0], metas[0], out)()
        expected = lora_kernels.reference.add_lora_multi(
            y.double(),
            x.double(),
            [a.double() for a in dense["lora_as"]],
            [b.double() for b in dense["lora_bs"]],
            slots,
            [c.double() for c in scales],
            slices,
        )
        err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
        micros = timer.graph([op(s, m) for s, m in zip(sets, metas)])
        memory = (
            dense["lora_as"] + dense["lora_bs"]
            if layout.startswith("slots")
            else paged["pool_as"] + paged["pool_bs"]
        )
        rows.append(dict(shape=shape, mix=mix, layout=layout, us=micros, err=err, mib=weights_mib(memory)))
        del sets, metas, dense, paged  # before the next layout's sets: model-wide ones take GBs
    return rows


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
        print("no CUDA device: nothing to benchmark (--dry-run checks the script)")
        return 0
    device = "cpu" if args.dry_run else "cuda"
    timer = Timer(args.dry_run, args.reps)
    l2 = 0 if args.dry_run else torch.cuda.get_device_properties(0).L2_cache_size
    name = "CPU (dry run: timings mean nothing)" if args.dry_run else torch.cuda.get_device_name(0)
    print(f"{name}; torch {torch.__version__}\n")
    print(
        "| shape | tokens | in -> out | adapters | ranks | layout | µs | vs slots | weights MiB | max rel err |"
    )
    print("|" + "---|" * 10)
    for shape in SHAPES:
        if args.only not in shape.name:
            continue
        shape = shape.small() if args.dry_run else shape
        for mix in MIXES:
            rows = run(shape, mix, timer, l2, device)
            us_of = {r["layout"]: r["us"] for r in rows}
            for r in rows:
                base = us_of["slots, model-wide" if "model-wide" in r["layout"] else "slots"]
                print(
                    f"| {shape.name} | {shape.num_tokens} | {shape.in_features} -> {'+'.join(map(str, shape.out_slices))} "
                    f"| {shape.num_adapters} | {mix} | {r['layout']} | {r['us']:.1f} | {r['us'] / base:.2f} "
                    f"| {r['mib']:.1f} | {r['err']:.1e} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
