"""Per-tenant token-rate limit: tokens per minute over a sliding 60-second window (429 beyond it).

What counts, and when: a request's prompt tokens when it is admitted, and the tokens it generates as
they are generated (the server charges each engine delta as it arrives), each in the window of the
moment it was used. A request that runs for minutes is charged minute by minute, and the window (GET
/v1/usage's `tokens_last_minute`) holds the tenant's real use, whatever its keys' limits.

What is held: until it ends, a request also holds what it may still generate, `n x max_tokens` per
prompt less what it has generated (max_tokens unset: nothing, since holding the whole context would
refuse every such request under a small limit). A new request is admitted only if the window's use,
the tenant's holds, and its own prompt plus hold fit the calling key's `max_tokens_per_minute` (None:
unlimited), as OpenAI estimates from max_tokens at admission.

Running requests are never cut when their tenant crosses its limit (vLLM and LoRAX have no such cut
either): a cut answer costs the client more than a refusal up front, and what a running request can add
is bounded by its max_tokens or the context. While the tenant is over, every new request of it gets 429
with Retry-After, so over any stretch of time it uses at most its limit plus what the requests already
running when it crossed it go on to generate.

Retry-After is exact for the window as it stands when aging out frees enough: the seconds until it
does; when the holds of running requests stand in the way, it is the whole window (60 s).

Charges within a second of each other are kept as one, dated by the latest, so a window holds at most
about 60 entries per tenant; tokens then leave the window up to a second late, never early.
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
_BUCKET_S = 1.0  # charges closer than this to a bucket's first one join it


class _Charge:
    __slots__ = ("at", "first", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.first = at  # when the bucket opened
        self.at = at  # its latest charge: it leaves the window WINDOW_S after this
        self.tokens = tokens


class _Window:
    """One tenant's charges in time order, their sum, and what its running requests hold."""

    __slots__ = ("charges", "held", "used")

    def __init__(self) -> None:
        self.charges: deque[_Charge] = deque()
        self.used = 0  # sum of the charges' tokens
        self.held = 0  # what running requests may still generate

    def expire(self, now: float) -> None:
        while self.charges and self.charges[0].at <= now - WINDOW_S:
            self.used -= self.charges.popleft().tokens

    def charge(self, now: float, tokens: int) -> None:
        last = self.charges[-1] if self.charges else None
        if last is not None and now - last.first < _BUCKET_S:
            last.tokens += tokens
            last.at = max(last.at, now)
        else:
            self.charges.append(_Charge(now, tokens))
        self.used += tokens


class TokenReservation:
    """One admitted request's account: `charge(tokens)` as it generates them, `release()` when it ends
    (idempotent: its remaining hold goes back; later charges still count, as real use)."""

    def __init__(self, limiter: TokenRateLimiter, window: _Window, held: int) -> None:
        self._limiter = limiter
        self._window = window
        self._held = held

    @property
    def held(self) -> int:
        return self._held

    def charge(self, tokens: int) -> None:
        """Tokens just generated: into the window now, and out of this request's hold."""
        if tokens <= 0:
            return
        now = self._limiter.clock()
        self._window.expire(now)
        self._window.charge(now, tokens)
        covered = min(self._held, tokens)
        self._held -= covered
        self._window.held -= covered

    def release(self) -> None:
        self._window.held -= self._held
        self._held = 0


class TokenRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    def used(self, tenant: str) -> int:
        """Tokens the tenant used in the last 60 s (its running requests' holds not included)."""
        window = self._windows.get(tenant)
        if window is None:
            return 0
        window.expire(self.clock())
        return window.used

    def held(self, tenant: str) -> int:
        """What the tenant's running requests may still generate (their max_tokens not yet used)."""
        window = self._windows.get(tenant)
        return 0 if window is None else window.held

    def try_reserve(
        self, principal: Principal, prompt_tokens: int, max_new_tokens: int = 0
    ) -> TokenReservation:
        """Admit a request of `prompt_tokens` that may generate `max_new_tokens` (0: unbounded, none
        held): charge its prompt now and hold the rest, or raise TooManyRequests (with Retry-After)."""
        now = self.clock()
        window = self._windows.setdefault(principal.tenant, _Window())
        window.expire(now)
        limit = principal.max_tokens_per_minute
        tokens = prompt_tokens + max_new_tokens
        if limit is not None:
            if tokens > limit:
                raise TooManyRequests(
                    f"this request may use {tokens} tokens (prompt plus n x max_tokens), more than the "
                    f"tenant's limit of {limit} tokens per minute; lower max_tokens, n or the prompt",
                    retry_after_s=math.ceil(WINDOW_S),
                )
            taken = window.used + window.held
            if taken + tokens > limit:
                retry = _retry_after_s(window, taken + tokens - limit, now)
                raise TooManyRequests(
                    f"tenant {principal.tenant!r} used {window.used} of its {limit} tokens per minute, its "
                    f"running requests may use {window.held} more, and this request may use {tokens}; "
                    f"retry in {retry} s or ask the operator for a higher max_tokens_per_minute",
                    retry_after_s=retry,
                )
        window.charge(now, prompt_tokens)
        window.held += max_new_tokens
        return TokenReservation(self, window, max_new_tokens)


def _retry_after_s(window: _Window, excess: int, now: float) -> int:
    """Seconds until the oldest charges, aging out, free at least `excess` tokens (holds stay put)."""
    freed = 0
    for charge in window.charges:
        freed += charge.tokens
        if freed >= excess:
            return max(1, math.ceil(charge.at + WINDOW_S - now))
    return math.ceil(WINDOW_S)  # the holds of running requests stand in the way: they end in their time
