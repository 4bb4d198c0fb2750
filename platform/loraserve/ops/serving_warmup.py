"""The serving warm-up: a few real requests through this process's whole request path before /ready.

The engine warms its kernels at start (engine/warmup.py); what it does not reach is the front end:
Litestar's routing and DI, body decoding, the tokenizer and chat template, the engine client's first
requests, detokenization and SSE framing. Each runs cold on the first request otherwise, so the first
workload after /ready would be the slowest. So, once the engine is up, every server process (each
front end of `--api-server-count`) sends its own app, in process, one small batch at once:

    a completion, a streaming completion, and, where the model has a chat template, a streaming chat
    completion and a non-streaming one (a few tokens each, greedy, fixed text: no tenant's data)

Each is an ASGI call straight into this process's app (not over the socket, which the kernel may hand
to another front end), marked in its ASGI scope, a place no HTTP client can write:
- it runs as tenant WARMUP_TENANT, a name no real tenant can have (names start with a letter or digit),
  role user: it sees the base model only, and its prefix-cache entries are its own;
- the front end's request metrics (loraserve:request_*, TTFT, TPOT, finish reasons) skip it; the engine's
  few tokens of it show in per-tenant series under tenant `_warmup`.

It is bounded (`--serving-warmup-timeout`); a failure or timeout is logged as a warning and the
process turns ready anyway: the warm-up only saves the first requests some time, and a broken engine
shows itself on /ready (engine_dead). `--no-serving-warmup` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from loraserve.tenancy.principal import Principal

log = logging.getLogger("loraserve")

WARMUP_TENANT = "_warmup"
WARMUP_PRINCIPAL = Principal(tenant=WARMUP_TENANT, role="user")
SCOPE_KEY = "loraserve.serving_warmup"  # in the ASGI scope of the warm-up's own requests only
MAX_TOKENS = 4
PROMPT = "Warm-up: the quick brown fox jumps over the lazy dog."


def is_warmup(scope: Any) -> bool:
    return bool(scope.get(SCOPE_KEY))


def warmup_requests(model: str, chat: bool) -> list[tuple[str, str, dict]]:
    """(what, path, body) of the batch."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    requests = [
        ("completion", "/v1/completions", {**common, "prompt": PROMPT}),
        ("streaming completion", "/v1/completions", {**common, "prompt": PROMPT, "stream": True}),
    ]
    if chat:
        messages = [{"role": "user", "content": PROMPT}]
        requests += [
            (
                "streaming chat completion",
                "/v1/chat/completions",
                {**common, "messages": messages, "stream": True},
            ),
            ("chat completion", "/v1/chat/completions", {**common, "messages": messages}),
        ]
    return requests


class WarmupFailed(Exception):
    pass


async def warm_up(app: Any, model: str, chat: bool, timeout_s: float, name: str = "the server") -> bool:
    """Run the batch at once; True when every request succeeded. Never raises (but on cancel)."""
    requests = warmup_requests(model, chat)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(_one(app, what, path, body) for what, path, body in requests))
    except TimeoutError:
        log.warning(
            "serving warm-up of %s: not done within %.0f s (--serving-warmup-timeout); ready anyway",
            name,
            timeout_s,
        )
        return False
    except Exception as exc:
        log.warning("serving warm-up of %s failed: %s; ready anyway", name, exc)
        return False
    log.info(
        "serving warm-up of %s done: %d requests (%s) in %.2f s",
        name,
        len(requests),
        ", ".join(what for what, _, _ in requests),
        time.perf_counter() - started,
    )
    return True


async def _one(app: Any, what: str, path: str, body: dict) -> None:
    status, data = await asgi_call(app, "POST", path, msgspec.json.encode(body))
    if status != 200:
        raise WarmupFailed(f"the {what} got HTTP {status}: {data[:300].decode(errors='replace')}")
    if body.get("stream") and not data.rstrip().endswith(b"data: [DONE]"):
        raise WarmupFailed(f"the {what}'s stream did not end with [DONE]")
    if b'"error"' in data:
        raise WarmupFailed(f"the {what} ended with an error: {data[-300:].decode(errors='replace')}")


async def asgi_call(app: Any, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP request straight into the ASGI `app`, marked as the warm-up's; (status, whole body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"serving-warmup"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 0),
        "server": None,
        "state": {},
        SCOPE_KEY: True,
    }
    done = asyncio.Event()
    body_sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client stays until the whole response is in, as a real one would
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)
