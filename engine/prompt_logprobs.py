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


def prompt_logprob_rows(scheduled: list[ScheduledRequest]) -> list[int]:
    """The step's hidden rows whose logits give prompt logprob entries, in the order they are computed
    (request by request). Under tensor parallelism rank 0 sends them, so the workers join the same
    logits gathers."""
    return [row for _, rows, _, _ in _wanted(scheduled) for row in rows]


def logit_chunk_rows(vocab_size: int) -> int:
    """Rows of logits computed at once: at most MAX_LOGIT_ELEMENTS floats (rank 0 tells the workers)."""
    return max(1, MAX_LOGIT_ELEMENTS // vocab_size)


def logit_chunks(num_rows: int, chunk_rows: int) -> list[slice]:
    """The pieces `num_rows` logits rows are computed in, `chunk_rows` each (the last may be shorter)."""
    return [slice(start, min(start + chunk_rows, num_rows)) for start in range(0, num_rows, chunk_rows)]


def compute_prompt_logprobs(
    compute_logits, vocab_size: int, scheduled: list[ScheduledRequest], device: torch.device
) -> dict[Request, list[PromptTokenLogprobs]]:
    """The new entries of each request of the step that asked for prompt logprobs.

    compute_logits: indices of the step's token rows (in `scheduled` order: each request's
    num_new_tokens rows, from its `start`) -> float32 logits [rows, vocab], called once per
    `logit_chunks` piece of `prompt_logprob_rows` (`logit_chunk_rows(vocab_size)` rows each); the rows
    say which adapter's head serves each (engine/lora/vocab.py).
    """
    wanted = _wanted(scheduled)
    rows = [row for _, request_rows, _, _ in wanted for row in request_rows]
    targets = [t for _, _, request_targets, _ in wanted for t in request_targets]
    ks = [k for _, request_rows, _, k in wanted for _ in request_rows]
    index = torch.tensor(rows, device=device)  # [num_rows]
    entries: list[PromptTokenLogprobs] = []
    for chunk in logit_chunks(len(rows), logit_chunk_rows(vocab_size)):
        logprobs = torch.log_softmax(compute_logits(index[chunk]).float(), dim=-1)  # [n, vocab]
        ids = torch.tensor(targets[chunk], device=logprobs.device)  # [n]
        chosen = logprobs.gather(-1, ids[:, None])  # [n, 1]
        ranks = (logprobs >= chosen).sum(dim=-1)  # [n]
        top_values, top_ids = logprobs.topk(max(ks[chunk]), dim=-1)  # [n, max k] each (k may be 0)
        for token_id, value, rank, values, top, k in zip(
            ids.tolist(),
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_values.tolist(),
            top_ids.tolist(),
            ks[chunk],
        ):
            entries.append(PromptTokenLogprobs(token_id, value, rank, dict(zip(top[:k], values[:k]))))
    result: dict[Request, list[PromptTokenLogprobs]] = {}
    offset = 0
    for request, request_rows, _, _ in wanted:
        result[request] = entries[offset : offset + len(request_rows)]
        offset += len(request_rows)
    return result


def _wanted(scheduled: list[ScheduledRequest]) -> list[tuple[Request, range, list[int], int]]:
    """(request, its hidden rows, the prompt tokens they predict, its k) of each request with entries due."""
    wanted = []
    offset = 0
    for s in scheduled:
        positions = _pending_positions(s)
        if len(positions):
            first_row = offset + positions.start - s.start
            targets = s.request.prompt_token_ids[positions.start + 1 : positions.stop + 1]
            k = s.request.sampling_params.prompt_logprobs
            wanted.append((s.request, range(first_row, first_row + len(positions)), targets, k))
        offset += s.num_new_tokens
    return wanted


def _pending_positions(s: ScheduledRequest) -> range:
    """Positions of this chunk whose hidden rows give missing entries (entries so far include token 0's)."""
    entries = s.request.prompt_logprobs
    if entries is None:
        return range(0)
    first = max(s.start, len(entries) - 1)
    stop = min(s.start + s.num_new_tokens, s.request.num_prompt_tokens - 1)
    return range(first, max(first, stop))
