"""A paged, continuously batching inference engine in which every request may use its own LoRA adapter."""

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import AdapterSourceFactory, LLMEngine, RequestError
from engine.lora.manager import AdapterSource, Observer
from engine.lora.model_shape import ModelShape
from engine.lora.peft_checkpoint import AdapterError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

__all__ = [
    "LLM",
    "AdapterError",
    "AdapterSource",
    "AdapterSourceFactory",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LLMEngine",
    "ModelShape",
    "Observer",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
