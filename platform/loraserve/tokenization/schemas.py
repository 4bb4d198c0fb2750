"""Request and response bodies of the tokenizer endpoints, with vLLM's field names and defaults."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from loraserve.inference.schemas import ChatMessage
from loraserve.inference.tools.types import ToolDefinition

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Either `prompt` (completions' text) or `messages` (rendered with the chat template), not both."""

    model: str | None = None  # optional as in vLLM; when given it must be one of the caller's models
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None  # vLLM's: rendered by the chat template, as in chat


class TokenizeResponse(msgspec.Struct, frozen=True, kw_only=True):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(msgspec.Struct, frozen=True, kw_only=True):
    prompt: str


class TokenizerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The base model's tokenizer settings a client needs to tokenize as the server does."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int | None
    max_model_len: int | None
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool | None
    chat_template: str | None
