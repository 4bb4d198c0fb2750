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

The counts live in a TenantTable (tenancy.tenant_table), this process's own or the one every
front-end process of the replica shares, in one-second buckets dated by their latest charge: tokens
leave the window up to a second late, never early. Admission checks and charges happen under one hold
of the table's lock. Generated tokens are charged per engine delta into a small buffer of this process,
written to the table at least every FLUSH_S (and before any admission, usage read or release here), so
streaming costs no lock per token; another process sees them at most FLUSH_S late.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from loraserve.tenancy.errors import TooManyRequests
from loraserve.tenancy.principal import Principal
from loraserve.tenancy.tenant_table import WINDOW_S, TenantTable

FLUSH_S = 0.1  # buffered charges reach the shared table at least this often


class TokenReservation:
    """One admitted request's account: `charge(tokens)` as it generates them, `release()` when it ends
    (idempotent: its remaining hold goes back; later charges still count, as real use)."""

    def __init__(self, limiter: TokenRateLimiter, tenant: str, held: int) -> None:
        self._limiter = limiter
        self._tenant = tenant
        self._held = held

    @property
    def held(self) -> int:
        return self._held

    def charge(self, tokens: int) -> None:
        """Tokens just generated: into the window now, and out of this request's hold."""
        if tokens <= 0:
            return
        covered = min(self._held, tokens)
        self._held -= covered
        self._limiter._buffer(self._tenant, tokens, covered)

    def release(self) -> None:
        held, self._held = self._held, 0
        self._limiter._buffer(self._tenant, 0, held)
        self._limiter.flush()


class TokenRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, table: TenantTable | None = None) -> None:
        self.clock = clock
        self.table = table if table is not None else TenantTable.in_process()
        # tenant -> [charges as {second: [latest time, tokens]}, hold to give back]
        self._pending: dict[str, list] = {}
        self._flushed_at = time.monotonic()

    def used(self, tenant: str) -> int:
        """Tokens the tenant used in the last 60 s (its running requests' holds not included)."""
        self.flush()
        now = self.clock()
        with self.table.locked() as table:
            return table.used(table.row(tenant, now=now, create=False), now)

    def held(self, tenant: str) -> int:
        """What the tenant's running requests may still generate (their max_tokens not yet used)."""
        self.flush()
        with self.table.locked() as table:
            return table.held(table.row(tenant, now=self.clock(), create=False))

    def try_reserve(
        self, principal: Principal, prompt_tokens: int, max_new_tokens: int = 0
    ) -> TokenReservation:
        """Admit a request of `prompt_tokens` that may generate `max_new_tokens` (0: unbounded, none
        held): charge its prompt now and hold the rest, or raise TooManyRequests (with Retry-After)."""
        self.flush()
        now = self.clock()
        limit = principal.max_tokens_per_minute
        tokens = prompt_tokens + max_new_tokens
        with self.table.locked() as table:
            row = table.row(principal.tenant, now=now)
            if limit is not None:
                if tokens > limit:
                    raise TooManyRequests(
                        f"this request may use {tokens} tokens (prompt plus n x max_tokens), more than the "
                        f"tenant's limit of {limit} tokens per minute; lower max_tokens, n or the prompt",
                        retry_after_s=math.ceil(WINDOW_S),
                    )
                used, held = table.used(row, now), table.held(row)
                if used + held + tokens > limit:
                    wait = table.seconds_until_freed(row, used + held + tokens - limit, now)
                    retry = math.ceil(WINDOW_S) if wait is None else max(1, math.ceil(wait))
                    raise TooManyRequests(
                        f"tenant {principal.tenant!r} used {used} of its {limit} tokens per minute, its "
                        f"running requests may use {held} more, and this request may use {tokens}; "
                        f"retry in {retry} s or ask the operator for a higher max_tokens_per_minute",
                        retry_after_s=retry,
                    )
            table.charge(row, now, prompt_tokens)
            table.add_held(row, max_new_tokens)
        return TokenReservation(self, principal.tenant, max_new_tokens)

    def flush(self) -> None:
        """Write this process's buffered charges and returned holds to the table."""
        self._flushed_at = time.monotonic()
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        with self.table.locked() as table:
            for tenant, (charges, unheld) in pending.items():
                row = table.row(tenant, now=self.clock())
                for latest, tokens in charges.values():
                    table.charge(row, latest, tokens)
                table.add_held(row, -unheld)

    def _buffer(self, tenant: str, tokens: int, unheld: int) -> None:
        entry = self._pending.get(tenant)
        if entry is None:
            entry = self._pending[tenant] = [{}, 0]
        if tokens:
            now = self.clock()
            bucket = entry[0].setdefault(math.floor(now), [now, 0])
            bucket[0] = max(bucket[0], now)
            bucket[1] += tokens
        entry[1] += unheld
        if time.monotonic() - self._flushed_at >= FLUSH_S:
            self.flush()
