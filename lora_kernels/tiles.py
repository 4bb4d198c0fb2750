"""Tile sizes, split-K and path choice, from shapes alone (no host sync, so CUDA-graph safe).

Why these numbers (H100: 132 SMs, ~3.3 TB/s HBM, 50 MB L2). LoRA at serving shapes is memory-bound: at
decode (64 tokens, rank 16, in 4096) the shrink reads 128 KB of A per adapter and does ~1 flop per byte.
What matters is bytes in flight, so:
- Gathered shrink: one token per program, a [BLOCK_R, BLOCK_K] tile of 8192 elements (16 KB of bf16,
  64 fp32 registers per thread at 4 warps) loaded as 16-byte vectors; K is split until there are about
  4 programs per SM, so 64 tokens x 8 splits = 512 programs each reading one 16 KB block of A.
  Tokens sharing an adapter share its A through L2, so HBM still sees each used A once.
- Gathered expand: one token per program and a [BLOCK_N, BLOCK_R] block of B of 8192 elements: 512
  output columns at rank 16, so out 4096 gives 8 blocks per token, 512 programs for 64 tokens.
- Segmented: tiles of one slot's tokens (LoRABatchMeta.block_m, 16..64 rows) so A and B blocks are read
  once per tile and fed to tl.dot, pipelined by Triton (cp.async, wgmma). K blocks of 128 (64 for tall
  tiles x large ranks) and output blocks of 128 down to 32 as tile height x rank grows: picked by
  compiling for sm90 so that nothing spills up to rank 256 in bf16/fp16 (fp32, the CPU/test dtype, may
  spill from rank 128). Fewer splits (about 1 program per SM, 2 splits at 4096 tokens): every expand
  program re-reads its tile's h partials, split_k x 4 KB for a 64 x rank-16 tile, against a 16 KB
  y block; wide output blocks (128) keep that re-read small.
- The gathered path is taken up to GATHER_MAX_TOKENS tokens (decode, mostly one token per adapter);
  beyond, per-token programs would pull each adapter's A and B through L2 once per token, so the
  segmented path, which reads them once per tile, takes over.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from lora_kernels.meta import choose_block_m, max_num_tiles

GATHER_MAX_TOKENS = 128
# h's token dimension is padded to a multiple of this, so its strides are divisible by 16 whatever the
# batch: Triton specialises int arguments on divisibility by 16 and would compile variants per batch size.
H_TOKEN_ALIGN = 16
MAX_GRID_TOKENS = 65535  # the gathered grids put tokens on a CUDA grid axis limited to 65535
MAX_SPLIT_K = 16
TILE_ELEMENTS = 8192  # elements of the weight block one gathered program loads per step
PATHS = ("gathered", "segmented")


@dataclass(frozen=True)
class ShrinkConfig:
    block_r: int
    block_k: int
    split_k: int
    k_per_split: int  # a multiple of block_k; split_k * k_per_split >= in_features
    num_warps: int
    dot_fp32: bool  # tl.dot in float32 (fp32 inputs, or the interpreter's broken bf16 dot)
    use_pdl: bool


@dataclass(frozen=True)
class ExpandConfig:
    block_r: int
    block_n: int
    num_warps: int
    dot_fp32: bool
    use_pdl: bool


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; 4 elsewhere, which keeps interpreted grids small."""
    return _num_sms(device.index) if device.type == "cuda" else 4


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch on sm90+; LORA_KERNELS_PDL=0 turns it off (e.g. to compare)."""
    if device.type != "cuda" or interpreting() or os.environ.get("LORA_KERNELS_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def choose_path(num_tokens: int) -> str:
    return "gathered" if num_tokens <= GATHER_MAX_TOKENS else "segmented"


def block_r(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def shrink_config(
    path: str,
    num_rows: int,
    num_slices: int,
    in_features: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    block_m: int = 0,
) -> ShrinkConfig:
    """`num_rows`: tokens (gathered) or the tile bound (segmented, whose tiles have `block_m` rows)."""
    br = block_r(max_rank)
    num_warps = 4
    if path == "gathered":
        block_k, programs_per_sm = min(512, max(32, TILE_ELEMENTS // br)), 4
    else:  # sizes from compiling for sm90: no register spills up to rank 256 in half precision
        programs_per_sm = 1
        block_k, num_warps = (128, 4) if block_m * br <= 1024 else (64, 8)
    block_k = min(block_k, max(16, triton.next_power_of_2(in_features)))
    max_split = min(MAX_SPLIT_K, triton.cdiv(in_features, block_k))
    wanted = triton.cdiv(programs_per_sm * num_sms(device), max(1, num_rows * num_slices))
    split_k = max(1, min(wanted, max_split))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    dot_fp32 = dtype == torch.float32 or interpreting()
    return ShrinkConfig(br, block_k, split_k, k_per_split, num_warps, dot_fp32, use_pdl(device))


def expand_config(
    path: str, max_rank: int, dtype: torch.dtype, device: torch.device, block_m: int = 0
) -> ExpandConfig:
    br = block_r(max_rank)
    if path == "gathered":
        block_n, num_warps = min(512, max(32, TILE_ELEMENTS // br)), 4
    else:  # the h tile, B block and output tile share the registers: narrower blocks for taller h tiles
        area = block_m * br
        block_n = 128 if area <= 1024 else 64 if area <= 4096 else 32 if block_m >= 64 else 16
        num_warps = 4 if area <= 1024 else 8
    dot_fp32 = dtype == torch.float32 or interpreting()
    return ExpandConfig(br, block_n, num_warps, dot_fp32, use_pdl(device))


@dataclass(frozen=True)
class LaunchConfigs:
    """Everything of one `add_lora_multi` call that Triton compiles into its kernels, beside the weights'
    fixed shapes: two calls with equal configs (and the same weights) share their compiled variants."""

    path: str
    block_m: int  # segmented tile height (LoRABatchMeta.block_m); 0 on the gathered path
    shrink: ShrinkConfig
    expand: ExpandConfig


def launch_configs(
    path: str,
    num_tokens: int,
    num_slots: int,
    num_slices: int,
    in_features: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LaunchConfigs:
    """The shrink and expand configs of a batch of `num_tokens` (the segmented path's tiles follow
    LoRABatchMeta: `choose_block_m` rows each, at most `max_num_tiles` of them)."""
    rows, block_m = num_tokens, 0
    if path == "segmented":
        block_m = choose_block_m(num_tokens, num_slots)
        rows = max_num_tiles(num_tokens, num_slots, block_m)
    # What the configs read from the device and the environment is part of the cache key.
    context = (num_sms(device), use_pdl(device), interpreting())
    return _launch_configs(path, rows, block_m, num_slices, in_features, max_rank, dtype, device, context)


@functools.lru_cache(maxsize=4096)  # a few entries per model; saves host time in every layer's call
def _launch_configs(
    path, rows, block_m, num_slices, in_features, max_rank, dtype, device, context
) -> LaunchConfigs:
    shrink = shrink_config(path, rows, num_slices, in_features, max_rank, dtype, device, block_m)
    return LaunchConfigs(path, block_m, shrink, expand_config(path, max_rank, dtype, device, block_m))


def padded_tokens(num_tokens: int) -> int:
    return -(-num_tokens // H_TOKEN_ALIGN) * H_TOKEN_ALIGN
