"""Log-probabilities of the prompt's own tokens (vLLM's `prompt_logprobs`), computed during prefill.

The hidden state at position p predicts token p + 1, so a prefill chunk of positions [start, end) gives
the entries of tokens start + 1 .. end that lie in the prompt. Token 0 has nothing before it: its entry
is None, as in vLLM. Chunks run in order; a preempted request recomputes from token 0 and keeps the
entries it already has. While entries are missing the request reads nothing from the prefix cache
(KVCacheManager.get_computed_blocks), so no position is skipped.

    prompt [t0 t1 t2 t3 t4], prefill chunks [0, 3) and [3, 5):
        chunk 1: hidden rows of positions 0, 1, 2 -> entries of t1, t2, t3
        chunk 2: hidden row of position 3        -> entry of t4
                 (position 4, the last prompt token, predicts the first generated token: no entry)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler_output import ScheduledRequest

# Logits are computed for at most this many floats at once (rows x vocab, 64 MiB in float32, twice that
# with the log-softmax): a long prefill chunk of a large-vocabulary model would otherwise need gigabytes
# the KV-cache profile never reserved.
MAX_LOGIT_ELEMENTS = 2**24


@dataclass(frozen=True)
class PromptTokenLogprobs:
    """One prompt token's log-probability under the model, given the tokens before it (raw logits:
    no temperature, penalty or bias applies to the prompt)."""

    token_id: int  # the prompt token
    logprob: float
    rank: int  # how many tokens are at least as likely (1: the most likely), as vLLM counts it
    top: dict[int, float]  # the top-k ids -> logprob, most likely first (k = params.prompt_logprobs)


def wants_prompt_logprobs(scheduled: list[ScheduledRequest]) -> bool:
    """Whether some request of the step still needs entries from the positions it computes (cheap for the
    usual step, where no request asked: one attribute read each)."""
    return any(s.request.prompt_logprobs is not None and len(_pending_positions(s)) for s in scheduled)


def compute_prompt_logprobs(
    hidden: torch.Tensor, compute_logits, vocab_size: int, scheduled: list[ScheduledRequest]
) -> dict[Request, list[PromptTokenLogprobs]]:
    """The new entries of each request of the step that asked for prompt logprobs.

    hidden: [num_tokens, hidden_size], the step's rows in `scheduled` order (each request's
    num_new_tokens rows, from its `start`); compute_logits: hidden rows -> float32 [rows, vocab].
    """
    result: dict[Request, list[PromptTokenLogprobs]] = {}
    offset = 0
    for s in scheduled:
        positions = _pending_positions(s)
        if len(positions):
            first_row = offset + positions.start - s.start
            rows = hidden[first_row : first_row + len(positions)]  # [rows, hidden_size]
            targets = s.request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            k = s.request.sampling_params.prompt_logprobs
            result[s.request] = _entries(rows, compute_logits, vocab_size, targets, k)
        offset += s.num_new_tokens
    return result


def _pending_positions(s: ScheduledRequest) -> range:
    """Positions of this chunk whose hidden rows give missing entries (entries so far include token 0's)."""
    entries = s.request.prompt_logprobs
    if entries is None:
        return range(0)
    first = max(s.start, len(entries) - 1)
    stop = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1)
    return range(first, max(first, stop))


def _entries(
    rows: torch.Tensor, compute_logits, vocab_size: int, targets: list[int], k: int
) -> list[PromptTokenLogprobs]:
    entries: list[PromptTokenLogprobs] = []
    step = max(1, MAX_LOGIT_ELEMENTS // vocab_size)
    for start in range(0, len(targets), step):
        logprobs = torch.log_softmax(compute_logits(rows[start : start + step]).float(), dim=-1)
        ids = torch.tensor(targets[start : start + step], device=logprobs.device)  # [n]
        chosen = logprobs.gather(-1, ids[:, None])  # [n, 1]
        ranks = (logprobs >= chosen).sum(dim=-1)  # [n]
        top_values, top_ids = logprobs.topk(k, dim=-1)  # [n, k] each (k may be 0)
        for token_id, value, rank, values, top in zip(
            ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_values.tolist(), top_ids.tolist()
        ):
            entries.append(PromptTokenLogprobs(token_id, value, rank, dict(zip(top, values))))
    return entries
