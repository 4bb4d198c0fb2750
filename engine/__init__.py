"""A paged, continuously batching inference engine in which every request may use its own LoRA adapter.

The public names are imported on first use, so that a process which needs one submodule (an adapter
loader process imports engine.lora.background_loads) does not pay for the whole engine and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "engine.llm",
    "AdapterError": "adapter_format.errors",
    "AdapterSource": "engine.lora.manager",
    "AdapterSourceFactory": "engine.llm_engine",
    "AsyncLLM": "engine.frontend.async_llm",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineDeadError": "engine.frontend.core_client",
    "EngineStartupError": "engine.frontend.core_client",
    "EngineStats": "engine.stats",
    "LLMEngine": "engine.llm_engine",
    "ModelShape": "adapter_format.model_shape",
    "model_shape": "engine.model.registry",
    "supported_architectures": "engine.model.registry",
    "Observer": "adapter_format.events",
    "RequestError": "engine.llm_engine",
    "RequestMeta": "engine.request_meta",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}
__all__ = [
    "LLM",
    "AdapterError",
    "AdapterSource",
    "AdapterSourceFactory",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStartupError",
    "EngineStats",
    "LLMEngine",
    "ModelShape",
    "Observer",
    "RequestError",
    "RequestMeta",
    "RequestOutput",
    "SamplingParams",
    "model_shape",
    "supported_architectures",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from adapter_format.errors import AdapterError
    from adapter_format.events import Observer
    from adapter_format.model_shape import ModelShape
    from engine.config import EngineConfig
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.core_client import EngineDeadError, EngineStartupError
    from engine.llm import LLM
    from engine.llm_engine import AdapterSourceFactory, LLMEngine, RequestError
    from engine.lora.manager import AdapterSource
    from engine.model.registry import model_shape, supported_architectures
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.request_meta import RequestMeta
    from engine.sampling_params import SamplingParams
    from engine.stats import EngineStats
