"""Prompts to token ids: completion prompts in OpenAI's four shapes, and chat messages via the chat template.

Tokenizing here rather than in the engine lets the server refuse an oversize prompt with a 400 before
anything is queued, and know the prompt token count for usage and metrics.
"""

from __future__ import annotations

from typing import Any

from loraserve.errors import BadRequest
from loraserve.inference.schemas import ChatMessage
from loraserve.inference.tools import add_tool_fields

MAX_PROMPTS = 64  # prompts in one completions request


def completion_prompts(
    prompt: str | list[Any], tokenizer: Any, max_model_len: int | None, truncate: int | None = None
) -> list[list[int]]:
    """`"text"`, `["a", "b"]`, `[1, 2, 3]` or `[[1, 2], [3]]` -> one token id list per prompt."""
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
    ids = [
        truncated(tokenize(p, tokenizer) if isinstance(p, str) else p, truncate, max_model_len)
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
    truncate: int | None = None,
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
    ids = truncated(tokenizer_ids(text, tokenizer, add_special_tokens=False), truncate, max_model_len)
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


def tokenizer_ids(text: str, tokenizer: Any, *, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def truncated(ids: list[int], keep: int | None, max_model_len: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens; -1 keeps as many as leave room for one output."""
    if keep is None:
        return ids
    if keep == -1:
        if max_model_len is None:
            return ids
        keep = max_model_len - 1
    if keep == 0:
        raise BadRequest("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    return ids[-keep:]


def tokenize(text: str, tokenizer: Any) -> list[int]:
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer: send the prompt as token ids", param="prompt")
    return list(tokenizer(text).input_ids)


def check_prompt_ids(ids: list[int], tokenizer: Any, max_model_len: int | None) -> None:
    if not ids:
        raise BadRequest("the prompt is empty", param="prompt")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens, but this model's context (max_model_len) is {max_model_len} "
            "tokens, prompt plus output; shorten the prompt",
            code="context_length_exceeded",
            param="prompt",
        )
    vocab = len(tokenizer) if tokenizer is not None else None
    if vocab is not None and any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"prompt token ids must lie in [0, {vocab})", param="prompt")


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
    """logit_bias, allowed_token_ids and stop_token_ids must name tokens of the vocabulary (a 400, before
    queueing)."""
    if tokenizer is None:
        return
    vocab = len(tokenizer)
    for name, ids in (
        ("logit_bias", params.logit_bias or {}),
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})", param=name
            )
