"""OpenAI request fields -> engine.SamplingParams, refusing what the engine cannot honour.

Sampling fields the request leaves unset take the model's defaults (`Services.sampling_defaults`, from
its generation_config.json), by the engine's own rule (engine.generation_config), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine import SamplingParams
from engine.generation_config import apply_generation_defaults
from loraserve.errors import BadRequest
from loraserve.inference.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.inference.structured import structured_params

MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completion_params(body: CompletionRequest, defaults: Mapping[str, Any]) -> SamplingParams:
    if body.echo:
        raise BadRequest("echo is not supported; the prompt is not repeated in the output", param="echo")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    return _params(body, max_tokens, body.logprobs, defaults)


def chat_params(body: ChatCompletionRequest, defaults: Mapping[str, Any]) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # None: generate until the end of the sequence or the context is full.
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _params(body, max_tokens, logprobs, defaults)


def _params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: Mapping[str, Any],
) -> SamplingParams:
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options can only be set when stream is true", param="stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise BadRequest(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    try:
        return apply_generation_defaults(
            defaults,
            n=body.n,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=stop,
            logprobs=logprobs,
            ignore_eos=body.ignore_eos,
            structured_outputs=structured_params(body),
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
