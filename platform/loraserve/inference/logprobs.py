"""Engine log-probabilities -> OpenAI's two logprobs shapes (completions' and chat's)."""

from __future__ import annotations

from typing import Any

from engine.sampler import TokenLogprobs
from loraserve.inference.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


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


def completion_logprobs(steps: list[TokenLogprobs], text: TokenText, offset: int = 0) -> CompletionLogprobs:
    """`offset`: characters already streamed, so text_offset continues across chunks."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for step in steps:
        token = text(step.token_id)
        tokens.append(token)
        token_logprobs.append(step.logprob)
        top = {text(t): lp for t, lp in step.top.items()}
        top.setdefault(token, step.logprob)  # as vLLM: the chosen token is always listed
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


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
