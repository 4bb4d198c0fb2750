"""Engine log-probabilities -> OpenAI's two logprobs shapes (completions' and chat's)."""

from __future__ import annotations

from typing import Any

from engine.prompt_logprobs import PromptTokenLogprobs
from engine.sampler import TokenLogprobs
from loraserve.inference.schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
)


class TokenText:
    """Decoded text of single token ids, cached per request (a vocabulary row is decoded once)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._as_ids = as_ids or tokenizer is None
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self._as_ids else self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def completion_logprobs(
    steps: list[TokenLogprobs],
    text: TokenText,
    offset: int = 0,
    prompt: tuple[list[int], list[PromptTokenLogprobs | None]] | None = None,
) -> CompletionLogprobs:
    """`offset`: characters already streamed, so text_offset continues across chunks. `prompt`: the
    prompt's ids and entries to list first (vLLM's echo with logprobs; the first token's values are null)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    prompt_ids, entries = prompt or ([], [])
    for token_id, logprob, top_ids in _steps(prompt_ids, entries, steps):
        token = text(token_id)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clamped(logprob))
        top = {token: _clamped(logprob)}  # as vLLM: the chosen token always, and first
        for t, lp in top_ids.items():
            top.setdefault(text(t), _clamped(lp))
        top_logprobs.append(top)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def _steps(prompt_ids: list[int], prompt: list[PromptTokenLogprobs | None], steps: list[TokenLogprobs]):
    """(token id, logprob or None, top) of each prompt token, then of each generated token."""
    for token_id, entry in zip(prompt_ids, prompt):
        yield (token_id, None, {}) if entry is None else (token_id, entry.logprob, entry.top)
    for step in steps:
        yield step.token_id, step.logprob, step.top


def prompt_logprobs_body(
    entries: list[PromptTokenLogprobs | None], text: TokenText
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or token id -> logprob, rank and text,
    the prompt token first, then its position's top-k (ranks 1..k)."""
    body: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        item = {str(entry.token_id): _logprob(entry.token_id, entry.logprob, entry.rank, text)}
        for rank, (token_id, logprob) in enumerate(entry.top.items(), start=1):
            item[str(token_id)] = _logprob(token_id, logprob, rank, text)
        body.append(item)
    return body


def _logprob(token_id: int, logprob: float, rank: int, text: TokenText) -> PromptLogprob:
    return PromptLogprob(logprob=_clamped(logprob), rank=rank, decoded_token=text(token_id))


def _clamped(logprob: float) -> float:
    """-inf is no JSON number: vLLM (and OpenAI) send -9999.0 for it."""
    return max(logprob, -9999.0)


def chat_logprobs(steps: list[TokenLogprobs], text: TokenText) -> ChatLogprobs:
    content = []
    for step in steps:
        token = text(step.token_id)
        top = [
            TopLogprob(token=text(t), logprob=lp, bytes=list(text(t).encode())) for t, lp in step.top.items()
        ]
        content.append(
            TokenLogprob(token=token, logprob=step.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)
