"""Host time of a mixed step's LoRA calls: every projection checked and planned in each call (before)
against once a step per launch group (engine/lora/context.py, after). Issue 34's eager-LoRA item.

    python3 benchmarks/lora_host_time.py                  # W1 shape S: 127 decodes + one 512-token chunk, N=64
    python3 benchmarks/lora_host_time.py --smoke          # tiny shape (checks that it runs)

What it times is the Python a mixed step runs around the LoRA kernels, and nothing else: the pool and
the activations live on PyTorch's `meta` device (shapes, dtypes and strides, no memory, no math), the
Triton path is chosen as on CUDA (value checks off, as on CUDA without validate), and the two kernel
launches of each call are counted but not made (a Triton launch's own host cost is the same before and
after). So it runs on any machine: these are host-time numbers measured on a CPU; the GPU's (the wall
time of a mixed step in benchmarks/mixed_step.py) are pending a GPU run. A step: `layers x groups`
calls (W1 S: 16 layers x 4 groups, the issue's 64 `add_lora_paged` calls).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import w1_setup as w1  # noqa: E402
from engine import model_shape  # noqa: E402
from engine.lora.context import LoRAContext  # noqa: E402
from engine.lora.pool import LoRAPool  # noqa: E402
from engine.lora.slots import lora_launches  # noqa: E402
from lora_kernels import ops, tiles  # noqa: E402

META = torch.device("meta")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["S", "L"], default="S")
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--decoding", type=int, default=127)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=200, help="mixed steps timed per variant")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.adapters, args.decoding, args.chunk, args.steps = "smoke", 4, 3, 8, 5
    return args


class Step:
    """One mixed step's LoRA inputs: x and y of every launch group, and each token's slot."""

    def __init__(self, args) -> None:
        self.shape = model_shape(w1.llama_config(args.shape))
        self.pool = LoRAPool(self.shape, args.adapters, args.rank, torch.bfloat16, META)
        self.groups = lora_launches(self.shape.targets)
        num_tokens = args.decoding + args.chunk
        self.token_slots = torch.empty(num_tokens, dtype=torch.int32, device=META)
        self.io = {}
        for group in self.groups:
            in_features = self.shape.module_dims(group[0])[0]
            out = sum(self.shape.module_dims(m)[1] for m in group)
            x = torch.empty(num_tokens, in_features, dtype=torch.bfloat16, device=META)
            self.io[group] = (torch.empty(num_tokens, out, dtype=torch.bfloat16, device=META), x)
        self.buckets = self.pool.rank_buckets

    def calls(self) -> int:
        return self.shape.num_layers * len(self.groups)

    def before(self) -> None:
        """Each call checked and planned from scratch (what LoRAContext.apply did)."""
        for layer in range(self.shape.num_layers):
            for group in self.groups:
                y, x = self.io[group]
                targets = [self.pool.layers[layer][m] for m in group]
                ops.add_lora_paged(
                    y,
                    x,
                    [t.lora_a for t in targets],
                    [t.lora_b for t in targets],
                    self.pool.page_table,
                    self.token_slots,
                    [t.scales for t in targets],
                    [t.lora_b.shape[1] for t in targets],
                    self.pool.slot_ranks(layer, group),
                    rank_buckets=self.buckets,
                    dora_scales=self.pool.dora_view(layer, group),
                    dora_slots=self.pool.dora_slots[layer],
                )

    def after(self) -> None:
        """The engine's path: one LoRAContext a step, its plans made once per launch group."""
        context = LoRAContext(self.pool, self.token_slots, self.buckets)
        for layer in range(self.shape.num_layers):
            for group in self.groups:
                y, x = self.io[group]
                context.apply(y, x, layer, group)


def as_on_cuda(launches: list[int]):
    """The Triton path as CUDA takes it, with the launches counted instead of made."""

    def resolve(device, backend, path, num_tokens):
        return "triton", tiles.choose_path(num_tokens) if path == "auto" else path

    def launch(*_args, **_kwargs):
        launches[0] += 1

    ops._resolve, ops.launch_shrink, ops.launch_expand = resolve, launch, launch
    ops._meta_for = lambda meta, token_slots, num_slots: meta  # LoRABatchMeta.build needs real slots


def time_steps(run, steps: int) -> list[float]:
    run()  # first call: caches (launch configs, views) filled
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    launches = [0]
    as_on_cuda(launches)
    step = Step(args)
    results = {}
    for name in ("before", "after"):
        launches[0] = 0
        times = time_steps(getattr(step, name), args.steps)
        per_step = launches[0] / (args.steps + 1)
        results[name] = (statistics.median(times), min(times), per_step)
        print(f"{name}: median {1e3 * results[name][0]:.3f} ms a step, {per_step:.0f} launches", flush=True)
    before, after = results["before"][0], results["after"][0]
    print(
        f"\nSummary: LoRA host time per mixed step ({args.decoding} decodes + {args.chunk}-token chunk, "
        f"N={args.adapters}, shape {args.shape}, {step.calls()} calls, buckets {step.buckets}), measured on "
        f"a CPU (GPU numbers pending): before {1e3 * before:.3f} ms, after {1e3 * after:.3f} ms "
        f"({before / max(after, 1e-12):.1f}x less); launches per step {results['before'][2]:.0f} / "
        f"{results['after'][2]:.0f}"
    )


if __name__ == "__main__":
    main()
