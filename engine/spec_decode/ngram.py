"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens: for the longest n in [min_n, max_n] whose last n tokens occur earlier in
    `token_ids`, the tokens after the latest such occurrence. Example, n = 2, k = 3:

        tokens  = [5 6 7 8 | 9 5 6]      suffix [5 6] occurs at 0; proposal [7 8 9]

    Empty when no suffix of at least `min_n` tokens occurs earlier.
    """
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens <= min_n:
        return []
    tokens = np.asarray(token_ids)
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
    return tokens[start : start + k].tolist()


class TokenHistory:
    """Each request's tokens as a numpy array, extended by what was appended since the last call (a
    fresh array from the whole list every step would cost O(length) of Python per request)."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def tokens(self, request) -> np.ndarray:
        """request.all_token_ids as an int64 array (a view of the request's buffer)."""
        buffer, count = self._arrays.get(request.request_id, (np.empty(0, np.int64), 0))
        total = request.num_tokens
        if total > len(buffer):
            grown = np.empty(max(2 * total, 64), np.int64)
            grown[:count] = buffer[:count]
            buffer = grown
        count = min(count, total)
        buffer[count:total] = request.all_token_ids[count:total]
        self._arrays[request.request_id] = (buffer, total)
        return buffer[:total]

    def free(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
