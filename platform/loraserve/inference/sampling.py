"""OpenAI request fields -> engine.SamplingParams, refusing what the engine cannot honour.

Sampling fields the request leaves unset take the model's defaults (`Services.sampling_defaults`, from
its generation_config.json), by the engine's own rule (engine.generation_config), as vLLM does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams
from engine.core.request_checks import check_logprobs
from engine.engine_args import EngineArgs
from engine.generation_config import apply_generation_defaults
from engine.sampling_params import WHOLE_VOCABULARY
from loraserve.errors import BadRequest
from loraserve.inference.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.inference.structured import structured_params

MAX_STOP_STRINGS = 16
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,18}", re.ASCII)  # a JSON object key naming a token id
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def echo_only(body: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the answer is the prompt (and its logprobs), nothing generated."""
    return body.echo and body.max_tokens == 0


@dataclass(frozen=True)
class LogprobsCap:
    """vLLM's --max-logprobs (-1: the whole vocabulary) and the vocabulary size (None: unknown)."""

    max_logprobs: int = EngineArgs.max_logprobs
    vocab_size: int | None = None

    def check(self, kind: str, value: int | None, param: str) -> None:
        """The engine's rule (engine.core.request_checks.check_logprobs), refused before queueing."""
        check_logprobs(kind, value, self.max_logprobs, self.vocab_size, param)


def completion_params(
    body: CompletionRequest, defaults: Mapping[str, Any], cap: LogprobsCap = LogprobsCap()
) -> SamplingParams:
    if body.logprobs is not None and body.logprobs < 0:
        raise BadRequest("`logprobs` must be a positive value.", param="logprobs")
    cap.check("sample", body.logprobs, "logprobs")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens == 0:
        if not body.echo:
            raise BadRequest(
                "max_tokens must be at least 1, got 0 (0 is for echo: the prompt alone, scored).",
                param="max_tokens",
            )
        # vLLM's prompt scoring: the engine runs one step for the prompt's logprobs; the token it
        # samples is left out of the answer (loraserve.inference.responses, echo_only)
        max_tokens = 1
    # vLLM's: echo with logprobs returns the prompt's logprobs too (prompt_logprobs defaults to logprobs)
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:
        prompt_logprobs = body.logprobs
    return _params(body, max_tokens, body.logprobs, prompt_logprobs, defaults, cap)


def chat_params(
    body: ChatCompletionRequest, defaults: Mapping[str, Any], cap: LogprobsCap = LogprobsCap()
) -> SamplingParams:
    top = body.top_logprobs
    if top is not None and top < WHOLE_VOCABULARY:
        raise BadRequest("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
    if top is not None and top != 0 and not body.logprobs:
        raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    cap.check("sample", top, "top_logprobs")
    logprobs = (top or 0) if body.logprobs else None
    # None: generate until the end of the sequence or the context is full.
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _params(body, max_tokens, logprobs, body.prompt_logprobs, defaults, cap)


def refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Options of OpenAI or vLLM this server does not have: a 400 naming the option when one is asked for."""
    asked = []
    if body.use_beam_search:
        asked.append(("use_beam_search", "beam search is not supported; sample with n and seed instead"))
    if body.logprob_token_ids:
        asked.append(
            ("logprob_token_ids", "logprobs of chosen token ids are not supported; use top_logprobs")
        )
    if isinstance(body, CompletionRequest):
        if body.suffix:
            asked.append(("suffix", "suffix is not currently supported"))
        if body.best_of is not None and body.best_of != body.n:
            asked.append(("best_of", "best_of is not supported; ask for n completions instead"))
    if asked:
        param, message = asked[0]
        raise BadRequest(message, param=param)


def _params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    defaults: Mapping[str, Any],
    cap: LogprobsCap,
) -> SamplingParams:
    refuse_unsupported(body)
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs < WHOLE_VOCABULARY:
            raise BadRequest("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
        if body.stream and body.prompt_logprobs != 0:
            raise BadRequest(
                "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
    cap.check("prompt", prompt_logprobs, "prompt_logprobs")
    # vLLM's rule: `{}` asks for nothing, so only a set field needs a stream
    if body.stream_options is not None and not body.stream_options.is_empty and not body.stream:
        raise BadRequest("stream_options can only be set when stream is true", param="stream_options")
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}.",
            param="min_tokens",
        )
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
            prompt_logprobs=prompt_logprobs,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
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
    # ASCII digits only: str.isdigit() and int() also take other scripts' digits ("١" is 1) and superscripts
    bad = [key for key in bias if not _TOKEN_ID_KEY.fullmatch(key)]
    if bad:
        raise BadRequest(
            f"logit_bias keys must be token ids written in ASCII digits (got {bad[0][:32]!r})",
            param="logit_bias",
        )
    return {int(key): value for key, value in bias.items()}
