"""OpenAI's request and response bodies for completions and chat completions (the supported subset).

Unknown request fields are ignored, as OpenAI-compatible servers do; fields this server cannot honour
are refused in sampling.py rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

MAX_N = 16  # completions per prompt: each is a full sequence in the batch
MAX_LOGPROBS = 20

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Stop = str | list[str] | None
# A 64-bit signed integer, as vLLM takes it (torch's generators refuse anything wider).
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Fields both endpoints share."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK | None = None  # vLLM's extension; -1 or 0: off
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's extension: logprobs name tokens as "token_id:123", exact where text is ambiguous
    return_tokens_as_token_ids: bool = False


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token id lists (checked in prompts.py;
    # msgspec cannot tell list[str] from list[int] inside one union).
    prompt: str | list[Any]
    logprobs: NumLogprobs | None = None
    echo: bool = False


class TextPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None


# ---- responses --------------------------------------------------------------------------------------


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[TokenLogprob]


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
