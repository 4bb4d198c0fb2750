"""The calling tenant's usage: the engine's per-tenant accounting plus the tenant's token-rate window.

Numbers are this replica's since it started (each replica schedules its own GPU). The tenant is always
the caller's: there is no parameter to name another one, so one tenant can never read another's.
"""

from __future__ import annotations

import msgspec

from engine.stats import TenantStats
from loraserve.services import Services
from loraserve.tenancy import Principal, require_admin


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "usage"
    tenant: str
    weight: float  # the calling key's weight in the fair scheduler
    requests: int  # engine requests admitted (one per prompt and completion: n = 2 counts 2)
    prompt_tokens: int  # counted when each of those requests is first admitted
    completion_tokens: int
    total_tokens: int
    queue_time_seconds: float  # summed over requests: arrival to first admission
    mean_queue_time_seconds: float
    share: float  # part of all weighted tokens this replica served in about the last minute, 0..1
    running: int
    waiting: int
    max_tokens_per_minute: int | None  # the calling key's limit; None: unlimited
    tokens_last_minute: int  # what the token-rate window holds now


def tenant_usage(services: Services, principal: Principal) -> TenantUsage:
    require_admin(principal)
    stats = _engine_stats(services, principal.tenant)
    requests = stats.num_requests if stats else 0
    queue_time = stats.queue_time_s if stats else 0.0
    prompt = stats.num_prompt_tokens if stats else 0
    completion = stats.num_generation_tokens if stats else 0
    return TenantUsage(
        tenant=principal.tenant,
        weight=principal.weight,
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        queue_time_seconds=queue_time,
        mean_queue_time_seconds=queue_time / requests if requests else 0.0,
        share=stats.share if stats else 0.0,
        running=stats.num_running if stats else 0,
        waiting=stats.num_waiting if stats else 0,
        max_tokens_per_minute=principal.max_tokens_per_minute,
        tokens_last_minute=services.token_limiter.used(principal.tenant),
    )


def _engine_stats(services: Services, tenant: str) -> TenantStats | None:
    stats_of = getattr(services.engine, "stats", None)  # None while the model loads
    stats = stats_of() if stats_of is not None else None
    for entry in getattr(stats, "tenants", ()):
        if entry.tenant == tenant:
            return entry
    return None
