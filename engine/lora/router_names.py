"""What cluster routers call an engine adapter: one rule, used by the KV events and the residency metrics.

Routers (the Gateway API Inference Extension's endpoint picker, llm-d's router) match what a replica
reports against the request's `model`. An engine adapter id names one version (the server's ids are
`tenant/name@version`); a router knows the adapter by the id without the version, `tenant/name`, which
is also what a client sends as `model` to route by it (loraserve resolves a `model` of the form
`your-tenant/name` like `name`). Ids without a numeric `@version` suffix pass unchanged.

    "alpha/support@3" -> "alpha/support"        "chat" -> "chat"        "a@b" -> "a@b"
"""

from __future__ import annotations

import hashlib

from adapter_format.names import strip_version


def router_name(adapter_id: str) -> str:
    """The adapter id without its `@version` suffix (the tenant-qualified name routers route by)."""
    return strip_version(adapter_id)


def lora_int_id(adapter_id: str) -> int:
    """A positive integer id for one adapter version, the same on every replica and across restarts.

    vLLM's KV events carry `lora_id`, its per-process adapter counter (kept for compatibility; routers key
    on `lora_name`). Here it is the first 62 bits of sha256(adapter id), plus one: never 0 (the base
    model's id in vLLM), within a signed 64-bit integer (Go routers decode it as `int`), and in practice
    unique.
    """
    digest = hashlib.sha256(adapter_id.encode("utf-8")).digest()
    return (int.from_bytes(digest[:8], "big") >> 2) + 1
