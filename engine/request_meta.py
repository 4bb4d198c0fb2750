"""Who a request is for and how the engine treats it, beside its tokens, sampling params and adapter.

One struct from the API to the scheduler: the HTTP layer builds it (loraserve.inference.generation),
the front end sends it inside AddRequest (engine/messages.py), LLMEngine.add_request hands it to each of
the request's sequences (`Request.meta`), and the scheduler, its policy and the prefix cache read it.
A new per-request field is one line here (with its check below) plus the code that reads it.
"""

from __future__ import annotations

import math

import msgspec

from engine.fairness import DEFAULT_TENANT


class RequestMeta(msgspec.Struct, frozen=True, kw_only=True):
    # Whose share of the engine the request uses (the fair policy's key; the server passes the caller's
    # tenant) and that tenant's weight: a tenant of weight 2 gets twice the share of weight 1.
    tenant: str = DEFAULT_TENANT
    tenant_weight: float = 1.0
    # vLLM's: under the "priority" policy, lower values are served first (ties by arrival) and preempted
    # last; any other policy refuses a non-zero priority (LLMEngine.add_request).
    priority: int = 0
    # vLLM's: prefix-cache blocks are read and shared only among requests of the same salt (None: with
    # every unsalted request); engine/kv_cache/block_hash.py.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        """Runs on construction and when AddRequest is decoded; a ValueError names the field."""
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"tenant must be a non-empty string (got {self.tenant!r})")
        weight = self.tenant_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ValueError(f"tenant_weight must be a positive number (got {weight!r})")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer (got {self.priority!r})")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None (got {self.cache_salt!r})")


def with_priority(meta: RequestMeta | None, priority: int) -> RequestMeta:
    """`meta` (default: RequestMeta()) with vLLM's `priority` argument folded in; a ValueError when both
    give a priority and they differ."""
    meta = meta if meta is not None else RequestMeta()
    if priority == 0 or priority == meta.priority:
        return meta
    if meta.priority != 0:
        raise ValueError(f"priority given twice ({priority} and meta.priority {meta.priority})")
    return msgspec.structs.replace(meta, priority=priority)
