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
    if body.echo and body.logprobs is not None:
        raise BadRequest(
            "echo with logprobs needs the prompt's logprobs, which this server does not return; "
            "drop one of them",
            param="echo",
        )
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    return _params(body, max_tokens, body.logprobs, defaults)


def chat_params(body: ChatCompletionRequest, defaults: Mapping[str, Any]) -> SamplingParams:
    if body.echo and body.logprobs:
        raise BadRequest("echo with logprobs is not supported; drop one of them", param="echo")
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
    if body.prompt_logprobs is not None:
        raise BadRequest(
            "prompt_logprobs is not supported: this server returns logprobs of generated tokens only",
            param="prompt_logprobs",
        )
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
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            speculative=body.speculative,
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if bias is None:
        return None
    bad = [key for key in bias if not key.isdigit()]
    if bad:
        raise BadRequest(f"logit_bias keys must be token ids (got {bad[0]!r})", param="logit_bias")
    return {int(key): value for key, value in bias.items()}
