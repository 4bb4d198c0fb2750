"""Per-tenant token-rate limit: tokens per minute over a sliding 60-second window (429 beyond it).

What counts: a request is charged when admitted with what it may use, its prompt tokens plus
`n x max_tokens` per prompt (max_tokens unset: the prompt alone, since charging the whole context would
refuse every such request under a small limit). When it ends its charge becomes what it used, prompt
plus generated tokens, so the window ends up holding real use and a client that asks for a large
max_tokens is held back only while its requests run. OpenAI counts the same way (an estimate from
max_tokens at admission).

The window is shared by a tenant's keys; the limit compared against it is the calling key's
`max_tokens_per_minute` (None: unlimited), as with the concurrency limit. Retry-After is exact for the
window as it stands: the seconds until enough of it has aged out for this request to fit.

Everything runs on one event loop; check-and-charge has no await in between, so no lock is needed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from loraserve.tenancy.errors import TooManyRequests
from loraserve.tenancy.principal import Principal

WINDOW_S = 60.0


class _Charge:
    __slots__ = ("at", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens


class TokenReservation:
    """One admitted request's charge; `settle(used)` replaces it with the use, once (later calls do nothing).

    The charge keeps its time: a request's tokens leave the window a minute after it was admitted.
    """

    def __init__(self, charge: _Charge | None) -> None:
        self._charge = charge

    def settle(self, used_tokens: int) -> None:
        if self._charge is not None:
            self._charge.tokens = max(0, used_tokens)
            self._charge = None


class TokenRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[str, deque[_Charge]] = {}

    def used(self, tenant: str) -> int:
        """Tokens the tenant's window holds now (charged in the last 60 s)."""
        return sum(c.tokens for c in self._window(tenant, self._clock()))

    def try_reserve(self, principal: Principal, tokens: int) -> TokenReservation:
        """Charge `tokens` to the caller's tenant, or raise TooManyRequests (with Retry-After)."""
        limit = principal.max_tokens_per_minute
        if limit is None:
            return TokenReservation(None)
        now = self._clock()
        window = self._window(principal.tenant, now)
        if tokens > limit:
            raise TooManyRequests(
                f"this request may use {tokens} tokens (prompt plus n x max_tokens), more than the tenant's "
                f"limit of {limit} tokens per minute; lower max_tokens, n or the prompt",
                retry_after_s=math.ceil(WINDOW_S),
            )
        used = sum(c.tokens for c in window)
        if used + tokens > limit:
            retry = self._retry_after_s(window, used + tokens - limit, now)
            raise TooManyRequests(
                f"tenant {principal.tenant!r} used {used} of its {limit} tokens per minute and this request "
                f"may use {tokens}; retry in {retry} s or ask the operator for a higher max_tokens_per_minute",
                retry_after_s=retry,
            )
        charge = _Charge(now, tokens)
        window.append(charge)
        return TokenReservation(charge)

    def _window(self, tenant: str, now: float) -> deque[_Charge]:
        window = self._windows.setdefault(tenant, deque())
        while window and window[0].at <= now - WINDOW_S:
            window.popleft()
        return window

    @staticmethod
    def _retry_after_s(window: deque[_Charge], excess: int, now: float) -> int:
        """Seconds until the oldest charges, aging out, free at least `excess` tokens."""
        freed = 0
        for charge in window:
            freed += charge.tokens
            if freed >= excess:
                return max(1, math.ceil(charge.at + WINDOW_S - now))
        return math.ceil(WINDOW_S)  # not reached: excess never exceeds what the window holds
