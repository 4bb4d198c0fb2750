"""OpenAI's request and response bodies for completions and chat completions (the supported subset).

Unknown request fields are ignored, as OpenAI-compatible servers do; fields this server cannot honour
are refused in sampling.py rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from loraserve.inference.tools.types import DeltaToolCall, MessageToolCall, ToolCall, ToolDefinition
from loraserve.merges.fields import MergedAdapters

MAX_N = 16  # completions per prompt: each is a full sequence in the batch
# Every integer field is bounded: a wider one cannot cross to the engine (msgpack, torch carry 64 bits), so
# it is refused here, naming the field, rather than failing later.
MAX_INT = 2**63 - 1
MAX_CHAT_MESSAGES = 4096  # messages in one chat request (the chat template renders every one)

PositiveInt = Annotated[int, Meta(ge=1, le=MAX_INT)]
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT)]  # checked against the vocabulary once the model is known
LogprobCount = Annotated[
    int, Meta(ge=-MAX_INT, le=MAX_INT)
]  # ranges checked in sampling.py (vLLM's messages)
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_INT)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
Stop = str | list[str] | None
# A 64-bit signed integer, as vLLM takes it (torch's generators refuse anything wider).
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300, vLLM any


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (one of its fields); options this server lacks are refused, not ignored."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's, as vLLM's server tests read it: the usage chunk only with include_usage true (`{}` asks
    for nothing), and the usage in every chunk only with continuous_usage_stats as well. Unset fields stay
    UNSET, so `{}` can be told from a set field (which needs a stream)."""

    include_usage: bool | None | UnsetType = UNSET
    continuous_usage_stats: bool | None | UnsetType = UNSET  # vLLM's: usage so far in every chunk

    @property
    def is_empty(self) -> bool:
        return self.include_usage is UNSET and self.continuous_usage_stats is UNSET

    @property
    def usage(self) -> bool:
        return self.include_usage is not UNSET and bool(self.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.usage and self.continuous_usage_stats is not UNSET and bool(self.continuous_usage_stats)


class _Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Fields both endpoints share."""

    model: str
    max_tokens: PositiveInt | None = None
    # Unset (None): the model's default from its generation_config.json, else 1.0, 1.0 and off.
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # vLLM's extension; -1 or 0: off
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    user: str | None = None
    # vLLM's: share prefix-cache blocks only with requests of this salt, always within the caller's
    # tenant (or cache group); a non-empty string. See loraserve.tenancy.cache_salt.
    cache_salt: Annotated[str, Meta(min_length=1)] | None = None
    # vLLM's: under --scheduling-policy priority, lower values are served first and preempted last; any
    # other policy refuses a non-zero priority (400, from the engine's check), never ignores it.
    priority: Annotated[int, Meta(ge=-(2**63), le=MAX_INT)] = 0
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's extensions: no stop before min_tokens; token ids that stop like eos; the stop string kept in
    # the text; special tokens' text kept
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's extension: logprobs name tokens as "token_id:123", exact where text is ambiguous
    return_tokens_as_token_ids: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM's extensions; unset (None): the model's generation_config.json, else 1.0 (off) and 0.0 (off).
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    # OpenAI's: token id (as a string key) -> bias added to its logit
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None  # vLLM's
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the prompt's and each choice's token ids in the response
    return_token_ids: bool = False
    # vLLM's: keep only the last k prompt tokens (-1: as many as the context allows)
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=MAX_INT)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end truncation drops; left
    # vLLM's: each prompt token's logprob, rank and top-k (checked against vLLM's rules in sampling.py)
    prompt_logprobs: LogprobCount | None = None
    # LoRAX's: serve a merge of several of the tenant's adapters (`model` must be the base model);
    # checked in loraserve.merges.spec, merged once per replica (loraserve.merges.service)
    merged_adapters: MergedAdapters | None = None
    # loraserve's: false keeps this request out of speculative decoding (a no-op when the server has none)
    speculative: bool = True
    # Options of vLLM this server does not have: accepted when off, refused (400) when asked for, never
    # silently ignored (sampling.py, refuse_unsupported)
    use_beam_search: bool = False
    logprob_token_ids: list[int] | None = None


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token id lists (checked in prompts.py;
    # msgspec cannot tell list[str] from list[int] inside one union). Missing, null or []: vLLM's 400.
    prompt: str | list[Any] | None = None
    # 0 only with echo: the prompt scored, nothing generated (OpenAI's and vLLM's); checked in sampling.py
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_INT)] | None = None
    logprobs: LogprobCount | None = None  # 0..--max-logprobs, checked in sampling.py with vLLM's messages
    echo: bool = False
    # OpenAI's, which this server refuses unless off (sampling.py): text after the completion; candidates
    best_of: Annotated[int, Meta(ge=1)] | None = None
    suffix: str | None = None


class TextPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    # Any role the chat template knows (vLLM passes custom roles through; a template that refuses one is a 400).
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls (content may be null)
    tool_call_id: str | None = None  # a `role: "tool"` message: the call it answers


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: LogprobCount | None = (
        None  # 0..--max-logprobs (-1: the whole vocabulary), checked in sampling.py
    )
    # vLLM's: render the last (assistant) message open so the model continues it; echo repeats it in the answer
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # Tool calling (inference/tools/): tool_choice "none" | "auto" | "required" | {"type": "function",
    # "function": {"name": ...}}, kept raw so that a bad one gets vLLM's message
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# ---- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (echo with logprobs)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's Logprob, as its prompt_logprobs lists them (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: one entry per prompt token, None for the first; token id (string key) -> logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    # vLLM's return_token_ids; null when not asked for (whole answers), left out of stream chunks
    prompt_token_ids: list[int] | None | UnsetType = UNSET
    token_ids: list[int] | None | UnsetType = UNSET
    # vLLM's: null unless prompt_logprobs was asked for (or echo with logprobs); left out of stream chunks
    prompt_logprobs: PromptLogprobs | None | UnsetType = UNSET


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
    content: str | None  # None: tool calls and no text
    tool_calls: list[ToolCall] | UnsetType = UNSET  # present when the response calls tools


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, on the response: null unless asked for


class ChatDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids: this chunk's new tokens


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids, in a choice's first chunk
