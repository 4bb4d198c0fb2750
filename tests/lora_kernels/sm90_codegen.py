"""What the LoRA kernels compile to for an H100 (sm90), on a machine without a GPU.

    TRITON_INTERPRET=0 python tests/lora_kernels/sm90_codegen.py    # prints JSON

Triton compiles for a target it is told (ptxas ships with it), so the code a kernel variant gets can be
checked anywhere: a compile-only driver answers sm90, and the kernel launches of the real launchers
compile their variant and stop there. For each case, both layouts (dense stacks through `add_lora_multi`'s
launchers, pages through `add_lora_paged`'s) and each kernel: the vector (16-byte) and scalar global
loads, the asynchronous copies, the shared memory and the barriers of its PTX.
test_paged_codegen.py compares the two layouts.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run with TRITON_INTERPRET=0: the interpreter compiles nothing")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from lora_kernels import LoRABatchMeta, tiles  # noqa: E402
from lora_kernels.expand_kernels import launch_expand  # noqa: E402
from lora_kernels.shrink_kernels import launch_shrink  # noqa: E402

PAGE = 8
H100_SMS = 132
# (name, tokens, in, output slices, adapters, ranks in turn, max rank): the benchmark's decode shapes.
CASES = [
    ("decode qkv", 64, 4096, [4096, 1024, 1024], 64, [16], 16),  # gathered path
    ("decode", 256, 4096, [14336], 64, [16], 16),  # segmented path
    ("decode qkv mixed", 64, 4096, [4096, 1024, 1024], 64, [8, 16, 64], 64),
]


class CompileOnlyDriver:
    """Enough of a Triton driver to compile for sm90: a target, a device and a stream, no CUDA."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


# Exit status when this Triton's launch path is not the one `compile_only` hooks (the test then skips).
UNSUPPORTED_TRITON = 77


def compile_only(compiled: list) -> None:
    """Kernel launches compile their variant, record it and return without running it."""
    run = JITFunction.run
    if not {"grid", "warmup"} <= set(inspect.signature(run).parameters):
        sys.exit(UNSUPPORTED_TRITON)

    def compile_and_record(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.__name__, kernel))
        return kernel

    JITFunction.run = compile_and_record


def ptx_stats(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)),
        "scalar_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b(?:16|32|64) ", ptx)),
        "async_copies": len(re.findall(r"cp\.async\.\w+\.shared\.global", ptx)),
        "barriers": len(re.findall(r"bar\.sync", ptx)),
        "shared": kernel.metadata.shared,
    }


def launch(num_tokens, in_features, outs, num_adapters, ranks, max_rank, paged) -> None:
    # The launch configs of a CUDA device; the tensors stay on the CPU (nothing runs).
    dtype, device = torch.bfloat16, torch.device("cuda")
    path = tiles.choose_path(num_tokens)
    conf = tiles.launch_configs(
        path, num_tokens, num_adapters, len(outs), in_features, max_rank, dtype, device
    )
    slots = (torch.arange(num_tokens) % num_adapters).to(torch.int32)
    slot_ranks = torch.tensor([ranks[i % len(ranks)] for i in range(num_adapters)], dtype=torch.int32)
    meta = LoRABatchMeta.build(slots, num_adapters) if path == "segmented" else None
    h_shape = (conf.shrink.split_k, len(outs), tiles.padded_tokens(num_tokens), max_rank)
    h = torch.empty(h_shape)[:, :, :num_tokens]
    x = torch.empty(num_tokens, in_features, dtype=dtype)
    y = torch.empty(num_tokens, sum(outs), dtype=dtype)
    scales = [torch.empty(num_adapters) for _ in outs]
    if paged:
        num_pages = num_adapters * max_rank // PAGE
        lora_as = [torch.empty(num_pages, PAGE, in_features, dtype=dtype) for _ in outs]
        lora_bs = [torch.empty(num_pages, w, PAGE, dtype=dtype) for w in outs]
        table = torch.zeros(num_adapters, max_rank // PAGE, dtype=torch.int32)
    else:
        lora_as = [torch.empty(num_adapters, max_rank, in_features, dtype=dtype) for _ in outs]
        lora_bs = [torch.empty(num_adapters, w, max_rank, dtype=dtype) for w in outs]
        table = None
    launch_shrink(h, x, lora_as, slots, slot_ranks, meta, path, conf.shrink, table)
    launch_expand(y, h, lora_bs, scales, slots, slot_ranks, outs, meta, path, conf.expand, table)


def main() -> int:
    driver.set_active(CompileOnlyDriver())
    tiles.num_sms = lambda device: H100_SMS
    tiles.use_pdl = lambda device: True
    compiled: list = []
    compile_only(compiled)
    report = {}
    for name, *case in CASES:
        for layout in ("dense", "paged"):
            launch(*case, paged=layout == "paged")
            report[f"{name}, {layout}"] = {kernel: ptx_stats(k) for kernel, k in compiled}
            compiled.clear()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
