"""Prompts to token ids: completion prompts in OpenAI's four shapes, and chat messages via the chat template.

Tokenizing here rather than in the engine lets the server refuse an oversize prompt with a 400 before
anything is queued, and know the prompt token count for usage and metrics. These functions are slow for
long inputs and run on the work pool (loraserve/work_pool.py), never on the event loop. Without
truncation a text longer than PREFIX_CHARS_PER_TOKEN characters per context token is first tokenized
only that far: if that prefix already fills the context the prompt is refused without tokenizing the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from engine.core.request_checks import check_prompt, check_token_ids
from loraserve.errors import BadRequest
from loraserve.inference.schemas import ChatMessage
from loraserve.inference.tools import add_tool_fields

MAX_PROMPTS = 64  # prompts in one completions request
# Text is about 4 characters a token; a prefix of 8 per context token holds the whole context in all but
# texts of unusually long tokens (long runs of one character), which are tokenized whole.
PREFIX_CHARS_PER_TOKEN = 8


def completion_prompts(
    prompt: str | list[Any] | None,
    tokenizer: Any,
    max_model_len: int | None,
    truncate: Truncation | None = None,
) -> list[list[int]]:
    """`"text"`, `["a", "b"]`, `[1, 2, 3]` or `[[1, 2], [3]]` -> one token id list per prompt."""
    if prompt is None or prompt == []:
        raise BadRequest(
            "Either prompt or prompt_embeds must be provided and non-empty (this server takes prompt; "
            "prompt_embeds is not supported).",
            param="prompt",
        )
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(_is_token_id(t) for t in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise BadRequest(
            "prompt must be a non-empty string, a list of strings, a list of token ids, or a list of "
            "non-empty token id lists",
            param="prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts per request (got {len(prompts)})", param="prompt")
    limit = max_model_len if truncate is None else None  # truncation keeps the last tokens: all are needed
    ids = [
        truncated(tokenize(p, tokenizer, limit) if isinstance(p, str) else p, truncate, max_model_len)
        for p in prompts
    ]
    for prompt_ids in ids:
        check_prompt_ids(prompt_ids, tokenizer, max_model_len)
    return ids


def chat_prompt(
    messages: list[ChatMessage],
    tokenizer: Any,
    max_model_len: int | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    truncate: Truncation | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render the messages with the model's chat template, then tokenize without adding specials twice."""
    text = render_chat(
        messages,
        tokenizer,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
    limit = max_model_len if truncate is None else None
    ids = truncated(
        tokenizer_ids(text, tokenizer, add_special_tokens=False, limit=limit), truncate, max_model_len
    )
    check_prompt_ids(ids, tokenizer, max_model_len)
    return ids


def render_chat(
    messages: list[ChatMessage],
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The messages as the model's chat template writes them (the text the model is prompted with);
    `tools` (OpenAI's function definitions) go to the template as `tools=`."""
    if tokenizer is None:
        raise BadRequest(
            "this model has no tokenizer, so chat is unavailable; use /v1/completions with token ids"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this model has no chat template (tokenizer_config.json has no 'chat_template'); "
            "use /v1/completions, or serve a model with a chat template",
            code="no_chat_template",
        )
    if add_generation_prompt and continue_final_message:
        raise BadRequest(
            "add_generation_prompt and continue_final_message cannot both be true",
            param="continue_final_message",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise BadRequest(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )
    conversation = [{"role": m.role, "content": _text(m, i)} for i, m in enumerate(messages)]
    add_tool_fields(conversation, messages)
    try:
        return tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **({"tools": tools} if tools else {}),
        )
    except Exception as exc:  # a template may reject e.g. a system message; that is the caller's to fix
        raise BadRequest(f"the chat template rejected these messages: {exc}", param="messages") from None


def tokenizer_ids(
    text: str, tokenizer: Any, *, add_special_tokens: bool = True, limit: int | None = None
) -> list[int]:
    """The text's token ids. With a `limit` (the context length), a text too long to fit is refused after
    tokenizing a prefix of PREFIX_CHARS_PER_TOKEN characters per token, when that prefix alone fills it."""
    if limit is not None and len(text) > limit * PREFIX_CHARS_PER_TOKEN:
        prefix = tokenizer(text[: limit * PREFIX_CHARS_PER_TOKEN], add_special_tokens=add_special_tokens)
        # +1: the prefix's last word may tokenize differently once the rest of it follows
        if len(prefix.input_ids) >= limit + 1:
            raise BadRequest(
                f"the prompt has more than {limit} tokens (its {len(text)} characters), but this model's "
                f"context (max_model_len) is {limit} tokens, prompt plus output; shorten the prompt",
                code="context_length_exceeded",
                param="prompt",
            )
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


class Truncation(NamedTuple):
    """vLLM's truncate_prompt_tokens (keep k tokens; -1: as many as leave room for one output token) and
    truncation_side: "left" (the default) drops the start, "right" the end."""

    keep: int
    side: str = "left"


def truncation(body: Any) -> Truncation | None:
    """A request's truncation, if it asked for one."""
    if body.truncate_prompt_tokens is None:
        return None
    return Truncation(body.truncate_prompt_tokens, body.truncation_side or "left")


def truncated(ids: list[int], truncate: Truncation | None, max_model_len: int | None) -> list[int]:
    if truncate is None:
        return ids
    keep = truncate.keep
    if keep == -1:
        if max_model_len is None:
            return ids
        keep = max_model_len - 1
    if keep == 0:
        raise BadRequest("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    return ids[:keep] if truncate.side == "right" else ids[-keep:]


def tokenize(text: str, tokenizer: Any, limit: int | None = None) -> list[int]:
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer: send the prompt as token ids", param="prompt")
    return tokenizer_ids(text, tokenizer, limit=limit)


def check_prompt_ids(ids: list[int], tokenizer: Any, max_model_len: int | None) -> None:
    """The engine's prompt checks (a RequestError, which the error table answers 400), before queueing."""
    check_prompt(ids, max_model_len, len(tokenizer) if tokenizer is not None else None)


def check_output_room(max_tokens: int | None, prompts: list[list[int]], max_model_len: int | None) -> None:
    """A request's max_tokens must fit in the context next to its longest prompt (vLLM's 400 and wording);
    None (chat without a cap) generates until the context is full."""
    if max_tokens is None or max_model_len is None or not prompts:
        return
    longest = max(len(p) for p in prompts)
    if max_tokens > max_model_len - longest:
        raise BadRequest(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {longest} input tokens "
            f"({max_tokens} > {max_model_len} - {longest}).",
            code="context_length_exceeded",
            param="max_tokens",
        )


def message_text(message: ChatMessage) -> str:
    return _text(message, 0)


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise BadRequest(
                f"messages[{index}] has a content part of type {part.type!r}; only text parts are supported",
                param=f"messages[{index}].content",
            )
        parts.append(part.text)
    return "".join(parts)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling_token_ids(params: Any, tokenizer: Any) -> None:
    """logit_bias, allowed_token_ids and stop_token_ids must name tokens of the vocabulary: the engine's
    check (a 400, before queueing)."""
    if tokenizer is not None:
        check_token_ids(params, len(tokenizer), stop_token_ids=True)
