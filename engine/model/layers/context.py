"""What every layer is built with: dtype, device, this rank's place, the FP8 settings, the kernels' path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.layers.sharding import SINGLE, TensorParallel


@dataclass(frozen=True)
class Fp8Settings:
    """FP8 projections (engine/model/fp8_checkpoint.py): the scheme, whether its scales come in 128x128
    blocks (then groups of 128 input columns per row), and the GEMM asked for."""

    scheme: str
    blocked: bool = False
    gemm: str = "auto"


@dataclass(frozen=True)
class BuildContext:
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel = SINGLE
    fp8: Fp8Settings | None = None
    attention_backend: str = "torch"  # "torch" or "triton"
    max_positions: int = 2048  # RoPE tables cover positions [0, max_positions)
    # The Triton path's fused element-wise kernels (norms with the residual add, RoPE, act-and-mul);
    # the model decides (engine/model/layers/decoder.py).
    fused: bool = False
    # Mixture-of-experts layers: whole experts per rank instead of a slice of every expert (vLLM's
    # --enable-expert-parallel; engine/model/layers/moe.py).
    expert_parallel: bool = False
