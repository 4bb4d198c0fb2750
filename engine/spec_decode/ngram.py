"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens: for the longest n in [min_n, max_n] whose last n tokens occur earlier in
    `token_ids`, the tokens after the latest such occurrence. Example, n = 2, k = 3:

        tokens  = [5 6 7 8 | 9 5 6]      suffix [5 6] occurs at 0; proposal [7 8 9]

    Empty when no suffix of at least `min_n` tokens occurs earlier.
    """
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Candidate occurrences, by the position of their last token (the suffix itself excluded).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if not len(ends):
        return []
    lengths = np.ones(len(ends), dtype=np.int64)  # matched suffix length at each candidate, up to max_n
    alive = np.ones(len(ends), dtype=bool)
    for i in range(1, min(max_n, num_tokens - 1)):
        alive &= ends >= i
        alive[alive] = tokens[ends[alive] - i] == tokens[num_tokens - 1 - i]
        if not alive.any():
            break
        lengths[alive] += 1
    best = int(lengths.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(lengths == best)[-1]]) + 1
    return token_ids[start : start + k]
