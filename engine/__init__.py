"""A paged, continuously batching inference engine in which every request may use its own LoRA adapter."""

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine, RequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
