"""Load a checkpoint (config.json + safetensors, sharded or not) from a folder or the hub into the model
class its config names (engine/model/registry.py)."""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine.engine_args import FP8_GEMMS, LOAD_FORMATS, EngineArgs
from engine.model.fp8_checkpoint import fp8_scheme, is_block_scaled
from engine.model.fp8_linear import Fp8Linear
from engine.model.layers.checkpoint_tensor import CheckpointTensor
from engine.model.layers.context import BuildContext, Fp8Settings
from engine.model.layers.decoder import DecoderModel
from engine.model.layers.sharding import SINGLE, TensorParallel
from engine.model.registry import model_class

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(model: str) -> Path:
    """A local folder as is; anything else is a hub id, downloaded through huggingface_hub's cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")):
        raise ValueError(f"model path {model!r} is not a folder holding config.json and safetensors weights")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=_HUB_PATTERNS))


def load_config(path: Path):
    return AutoConfig.from_pretrained(str(path))


def checkpoint_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = [p.name for p in path.glob("*.bin")]
        hint = (
            f" (found {found}: pickled checkpoints are not loaded; convert them to safetensors)"
            if found
            else ""
        )
        raise ValueError(f"{path} holds no .safetensors weights{hint}")
    return files


def load_model(
    path: Path,
    config,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int = 2048,
    attention_backend: str = "torch",
    quantization: str | None = None,
    fp8_gemm: str = EngineArgs.fp8_gemm,
    tp: TensorParallel = SINGLE,
    load_format: str = EngineArgs.load_format,
    expert_parallel: bool = False,
) -> DecoderModel:
    """The architecture's model (engine/model/registry.py) with this rank's shard of every weight.

    Each parameter reads only its own rows or columns of each checkpoint tensor (safetensors slices),
    so a rank never holds a whole tensor it shards. With FP8 (`quantization="fp8"`, or a checkpoint in a
    supported FP8 format) the linear projections hold float8 weights with float32 scales
    (engine/model/fp8_checkpoint.py); everything else keeps `dtype`. `load_format="dummy"` reads no
    weights: random ones, made on the device (a model's shape for benchmarks, from config.json alone)."""
    cls = model_class(config)
    scheme = fp8_scheme(config, quantization, cls.dequantized_methods)
    fp8 = None if scheme is None else Fp8Settings(scheme, is_block_scaled(config), fp8_gemm)
    if fp8 is not None and fp8_gemm not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)} (got {fp8_gemm!r})")
    ctx = BuildContext(
        dtype, device, tp, fp8, attention_backend, max_positions, expert_parallel=expert_parallel
    )
    model = cls(config, ctx)
    if load_format == "dummy":
        model.fill_dummy_weights()
        return model
    if load_format != "auto":
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)} (got {load_format!r})")
    with ExitStack() as files:
        tensors = []
        for file in _weight_files(path):
            handle = files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            tensors.extend(CheckpointTensor(handle, name) for name in handle.keys())
        model.load_weights(tensors, str(path))
    if fp8 is not None:
        gemms = sorted(
            {m.kernel.gemm for m in model.modules() if isinstance(getattr(m, "kernel", None), Fp8Linear)}
        )
        logger.info("FP8 weights: %s, GEMM %s", scheme, ", ".join(gemms))
    return model
