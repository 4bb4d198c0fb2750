"""The engine's one validated configuration: engine/engine_args.py's settings, the model, and torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.engine_args import DTYPES, EngineArgs
from engine.kv_events.config import KVEventsConfig
from engine.model.kv_quant import FP8_DTYPE
from engine.spec_decode.config import SpeculativeConfig

# The names are engine.engine_args.DTYPES; torch has an attribute of each name (torch.half, ...).
_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass(frozen=True)
class EngineConfig(EngineArgs):
    """One engine's model and settings: the settings are declared in engine/engine_args.py (checked
    there); this adds the model and what needs torch."""

    model: str

    @classmethod
    def from_args(cls, args: EngineArgs, model: str) -> EngineConfig:
        """The engine's config from any object that embeds its settings (the server's settings do)."""
        return cls(model=model, **args.engine_args())

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.speculative_config is not None and self.async_scheduling is True:
            # A step's kept tokens (1 to k + 1) must be known before the next step is scheduled, so
            # speculative decoding runs steps one at a time (vLLM v1 started so too).
            object.__setattr__(self, "async_scheduling", False)
        super().__post_init__()
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from None

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def loads_in_processes(self) -> bool:
        """Whether adapters are read in loader processes (see engine.engine_args.ADAPTER_LOADERS)."""
        if self.adapter_loader == "auto":
            return self.torch_device.type == "cuda"
        return self.adapter_loader == "process"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_attention_backend(self) -> str:
        """The backend in use ("torch" or "triton"): auto picks Triton on CUDA, torch elsewhere."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch"

    @property
    def use_cuda_graphs(self) -> bool:
        return (
            not self.enforce_eager
            and self.torch_device.type == "cuda"
            and self.resolved_attention_backend == "triton"
        )

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The compute dtype: explicit, or chosen from the device and the checkpoint."""
        if self.dtype != "auto":
            return _TORCH_DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype K/V are stored in: the model's, or float8 e4m3 for "fp8"."""
        return model_dtype if self.kv_cache_dtype == "auto" else FP8_DTYPE
