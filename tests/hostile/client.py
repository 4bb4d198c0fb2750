"""The probe's HTTP side: one asyncio httpx client, every call bounded, and an SSE reader that can cut a
stream at a chosen point (before its first token, after k chunks)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

CALL_TIMEOUT_S = 90.0


def auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


@dataclass
class StreamResult:
    status: int
    chunks: int = 0  # data events with a choice
    done: bool = False  # data: [DONE] seen
    error: dict | None = None  # an error event
    cut: bool = False  # we closed it on purpose
    text: str = ""  # the body of a non-200 answer
    seconds: float = 0.0


class Api:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=CALL_TIMEOUT_S, limits=limits)

    async def close(self) -> None:
        await self.client.aclose()

    async def call(self, method: str, path: str, key: str | None, **kwargs) -> httpx.Response:
        headers = {**auth(key), **kwargs.pop("headers", {})}
        return await self.client.request(method, path, headers=headers, **kwargs)

    async def timed(self, method: str, path: str, key: str | None, **kwargs) -> tuple[httpx.Response, float]:
        start = time.monotonic()
        response = await self.call(method, path, key, **kwargs)
        return response, time.monotonic() - start

    async def stream(
        self, path: str, key: str, body: dict, cut_after: int | None = None, cut_before_first: bool = False
    ) -> StreamResult:
        """POST a streaming request; cut_before_first closes it once the headers are sent but before any
        chunk is read, cut_after=k once k chunks arrived."""
        start = time.monotonic()
        result = await self._stream(path, key, body, cut_after, cut_before_first)
        result.seconds = time.monotonic() - start
        return result

    async def _stream(self, path: str, key: str, body: dict, cut_after: int | None, cut_first: bool):
        async with self.client.stream("POST", path, headers=auth(key), json={**body, "stream": True}) as r:
            result = StreamResult(r.status_code)
            if r.status_code != 200:
                result.text = (await r.aread()).decode(errors="replace")
                return result
            if cut_first:
                result.cut = True
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"]
                elif event.get("choices"):
                    result.chunks += 1
                    if cut_after is not None and result.chunks >= cut_after:
                        result.cut = True
                        break
            return result


async def cut_before_headers(base_url: str, key: str, body: dict, wait_s: float = 0.05) -> None:
    """Send a streaming request and hang up before the answer's headers: the client that leaves while its
    request waits in the queue."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    await asyncio.sleep(wait_s)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def gather_bounded(coroutines, limit: int) -> list:
    """Run coroutines at most `limit` at once; exceptions are returned, not raised."""
    semaphore = asyncio.Semaphore(limit)

    async def one(coroutine):
        async with semaphore:
            return await coroutine

    return await asyncio.gather(*(one(c) for c in coroutines), return_exceptions=True)
