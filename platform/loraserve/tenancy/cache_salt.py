"""Who may share prefix-cache blocks: the engine's cache salt for a request, from its caller and its own salt.

The engine shares KV blocks only between requests of equal salts (engine/kv_cache/block_hash.py). Every
request the server submits is salted with its scope, so one tenant never reads another's cached blocks,
and `usage.prompt_tokens_details.cached_tokens` (or the time to first token) cannot tell it what another
tenant sent:

    scope                                     salt
    tenant alice                              ["tenant", "alice", null]
    tenant alice, cache_salt "s1"             ["tenant", "alice", "s1"]
    any tenant whose key names group "acme"   ["group", "acme", null]

A key's `cache_group` is the operator's opt-in for tenants that want to share a common system prompt:
every tenant whose key names the group shares with the others of it, and with nobody else. A request's
vLLM `cache_salt` only narrows sharing within its scope, never across it. The salt is JSON of fixed
arity, so no tenant, group or request salt can spell another scope's salt.
"""

from __future__ import annotations

import msgspec

from loraserve.tenancy.principal import Principal


def engine_cache_salt(principal: Principal, request_salt: str | None = None) -> str:
    """The engine's cache salt for a request of `principal` carrying vLLM's `cache_salt` (None: none)."""
    if principal.cache_group is not None:
        scope = ("group", principal.cache_group)
    else:
        scope = ("tenant", principal.tenant)
    return msgspec.json.encode([*scope, request_salt]).decode()
