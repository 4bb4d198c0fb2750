"""Who is calling: the tenant, the role, and the key's own limits and fair-share weight."""

from __future__ import annotations

import msgspec

from loraserve.tenancy.keys import ApiKey, Role

DEFAULT_TENANT = "default"


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    role: Role
    max_concurrent: int | None = None  # None: the limiter's default
    key_id: str | None = None  # non-secret handle of the key (hash prefix); None in open mode
    weight: float = 1.0  # the tenant's weight in the engine's fair scheduler
    max_tokens_per_minute: int | None = None  # None: no token-rate limit
    cache_group: str | None = None  # tenants of one group share the prefix cache; None: this tenant alone

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @classmethod
    def from_key(cls, key: ApiKey) -> Principal:
        return cls(
            tenant=key.tenant,
            role=key.role,
            max_concurrent=key.max_concurrent_requests,
            key_id=key.key_id,
            weight=key.weight,
            max_tokens_per_minute=key.max_tokens_per_minute,
            cache_group=key.cache_group,
        )


# Open mode (no keys configured anywhere): every request is the default tenant with admin rights.
OPEN_MODE_PRINCIPAL = Principal(tenant=DEFAULT_TENANT, role="admin")
