"""Speculative decoding's counters, as the engine publishes them in EngineStats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    """vLLM's counters, cumulative: vllm:spec_decode_num_drafts (verifications with proposals),
    ..._num_draft_tokens, ..._num_accepted_tokens, ..._num_accepted_tokens_per_pos (by position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
