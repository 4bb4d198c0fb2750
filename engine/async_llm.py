"""Kept for `from engine.async_llm import AsyncLLM`: the streaming API now lives in engine.frontend,
with the engine in a process of its own (engine.core_process)."""

from engine.frontend.async_llm import AsyncLLM
from engine.frontend.core_client import EngineDeadError, EngineStartupError

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStartupError"]
