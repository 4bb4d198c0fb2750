"""Per-request edits of a step's logits before sampling: penalties, logit_bias, allowed_token_ids, min_p.

Named and defined as in vLLM and OpenAI:
- `repetition_penalty` (> 0, 1 = off): a token already in the prompt or the output has its logit divided by
  the penalty when positive, multiplied when negative (the CTRL rule).
- `presence_penalty` / `frequency_penalty` (in [-2, 2], 0 = off): subtract `presence` once and `frequency`
  per occurrence for every token already generated (the output only, as OpenAI defines them).
- `logit_bias` ({token id: bias in [-100, 100]}): added to those tokens' logits.
- `allowed_token_ids`: every other token is masked.
- `min_p` (in [0, 1], 0 = off): tokens whose probability, after temperature, is below `min_p` times the
  most likely one's are masked; in logit space that is `logit < max_logit + temperature * ln(min_p)`.

Only rows that ask for something are touched, so a batch without these fields pays one Python check per row.
Logprobs are computed after these edits (they describe the distribution the token was drawn from).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams


def uses_processors(params: SamplingParams) -> bool:
    return bool(
        params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
        or params.logit_bias
        or params.allowed_token_ids is not None
        or (params.min_p > 0.0 and not params.greedy)
    )


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [num_rows, vocab], row i belongs to requests[i]; edited in place and returned."""
    with torch.inference_mode():  # the runner's logits are inference tensors: edit them in that mode
        for i, request in enumerate(requests):
            _apply(logits[i], request)
    return logits


def _apply(row: torch.Tensor, request: Request) -> None:
    """row: [vocab]"""
    params = request.sampling_params
    if not uses_processors(params):
        return
    if params.repetition_penalty != 1.0:
        _repetition_penalty(row, request.all_token_ids, params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        _presence_frequency(row, request.output_token_ids, params.presence_penalty, params.frequency_penalty)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=row.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, bias)
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[torch.tensor(params.allowed_token_ids, device=row.device)] = True
        row.masked_fill_(~keep, float("-inf"))
    if params.min_p > 0.0 and not params.greedy:
        floor = row.max() + params.temperature * math.log(params.min_p)
        row.masked_fill_(row < floor, float("-inf"))


def _repetition_penalty(row: torch.Tensor, seen: list[int], penalty: float) -> None:
    ids = torch.tensor(sorted(set(seen)), device=row.device)
    values = row[ids]
    row[ids] = torch.where(values > 0, values / penalty, values * penalty)


def _presence_frequency(row: torch.Tensor, output: list[int], presence: float, frequency: float) -> None:
    if not output:
        return
    counts = Counter(output)
    ids = torch.tensor(list(counts), device=row.device)
    occurrences = torch.tensor(list(counts.values()), dtype=row.dtype, device=row.device)
    row.index_add_(0, ids, -(presence + frequency * occurrences))
