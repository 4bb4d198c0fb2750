"""Store-shaped probes (issue 30 items 5, 6, 7 and the earlier passes): the adapter disk cache past its
budget, uploads that are invalid at their header, concurrent uploads, a route PUT racing a delete,
deleting while streaming, 900 streams with cuts under uploads and route changes, SIGTERM mid-upload and
kill -9 of the engine core."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time

import httpx
import psutil
from client import Api, gather_bounded
from probes_input import UPLOAD_FILES, upload_form
from probes_load import LONG, SMALL, stream_ok
from stack import Stack, admin, user
from tally import Tally

JUNK = 1 << 20  # a chunk of an invalid upload's body


async def upload(api: Api, tenant: str, name: str, files=None, attempts: int = 60) -> httpx.Response:
    """An upload, retried while the tenant's concurrent-upload cap answers 429."""
    for _ in range(attempts):
        response = await api.call("POST", "/v1/adapters", admin(tenant), **upload_form(name, files))
        if response.status_code != 429:
            return response
        await asyncio.sleep(0.3)
    return response


async def disk_cache(api: Api, tally: Tally, stack: Stack, num_adapters: int) -> None:
    """More adapters than the cache's budget holds, each asked for in turn: the cache must evict, never
    refuse; /ready must stay 200."""
    tally.begin("5 adapter disk cache past its budget")
    for i in range(num_adapters):
        files = UPLOAD_FILES[f"adapter-{i % len(stack.adapter_dirs)}"]
        tally.answer(await upload(api, "alice", f"cache-{i}", files), refuse=False, what=f"upload cache-{i}")
    for round_ in range(5):
        for i in range(num_adapters):
            body = {**SMALL, "model": f"cache-{i}", "max_tokens": 1}
            tally.answer(
                await api.call("POST", "/v1/completions", user("alice"), json=body),
                refuse=False,
                what=f"cache-{i} round {round_}",
            )
    ready = await api.call("GET", "/ready", None)
    tally.answer(ready, refuse=False, what="/ready after evictions")
    if "degraded" in ready.text and "room" in ready.text:
        tally.failed("other", f"/ready reports the cache out of room: {ready.text[:200]}")
    tally.row().note(
        "info: a real ENOSPC is not played here (needs a small file system); see test_cache_disk_full.py"
    )


def _invalid_upload(base_url: str, key: str, megabytes: int) -> tuple[int, bytes, float]:
    """A multipart upload whose safetensors header is garbage, followed by `megabytes` of data, sent
    slowly enough that the server's staging could be seen growing."""
    host, port = base_url.removeprefix("http://").split(":")
    boundary = "probe-boundary"
    config = UPLOAD_FILES["good"][0]
    head = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\ninvalid-big\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="adapter_config.json"\r\n'
            f"Content-Type: application/json\r\n\r\n"
        ).encode()
        + config
        + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="files"; '
            f'filename="adapter_model.safetensors"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
    )
    bad_header = (64).to_bytes(8, "little") + b"{" + b"x" * 63  # a 64-byte header that is not JSON
    tail = f"\r\n--{boundary}--\r\n".encode()
    length = len(head) + len(bad_header) + megabytes * JUNK + len(tail)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {length}\r\n\r\n".encode()
            + head
            + bad_header
        )
        try:
            for _ in range(megabytes):
                sock.sendall(b"\0" * JUNK)
            sock.sendall(tail)
        except OSError:
            pass  # the server refused at the header and closed: what it should do
        sock.settimeout(30)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and b"}}" in answer:
                    break
        except OSError:
            pass
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer, time.monotonic() - start


async def uploads(api: Api, tally: Tally, stack: Stack) -> None:
    tally.begin("6 uploads: header first, one copy, per-tenant cap")
    before = set(stack.staged_files())
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, stack.staged_bytes())
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    for concurrent in (1, 3, 3):  # three at once: the cap (2) refuses one with 429
        jobs = [
            asyncio.to_thread(_invalid_upload, api.base_url, admin("carol"), 64) for _ in range(concurrent)
        ]
        for status, answer, _ in await asyncio.gather(*jobs):
            tally.tried()
            text = answer.decode(errors="replace")
            if status >= 500 or status == 0:
                tally.failed("server_errors", f"an invalid 64 MiB upload got {status}: {text[:160]}")
            elif status < 400:
                tally.failed("wrongly_accepted", f"an invalid upload was stored ({status})")
            tally.scan(text, "invalid upload")
    done.set()
    await watcher
    if peak > 8 << 20:
        tally.failed(
            "leaks", f"invalid uploads staged {peak / 2**20:.0f} MiB before their header was refused"
        )
    tally.row().note(f"info: peak staging {peak / 2**20:.1f} MiB for 64 MiB invalid uploads")
    # 20 uploads of one name at once (bob's cap of 2 turns the rest into retries): versions 1..20, once each
    answers = await asyncio.gather(*(upload(api, "bob", "same-name") for _ in range(20)))
    versions = []
    for answer in answers:
        tally.answer(answer, refuse=False, what="one of 20 concurrent uploads")
        if answer.status_code == 201:
            versions.append(answer.json()["version"])
    if sorted(versions) != list(range(1, len(versions) + 1)) or len(versions) != 20:
        tally.failed("other", f"20 concurrent uploads gave versions {sorted(versions)}")
    await asyncio.sleep(1.0)
    left = set(stack.staged_files()) - before
    if left:
        tally.failed("leaks", f"uploads left {len(left)} files in the staging folder: {sorted(left)[:3]}")


async def route_race(api: Api, tally: Tally, rounds: int) -> None:
    """A route PUT naming name@v racing the deletion of name@v: afterwards the route must never point at a
    version that is gone."""
    tally.begin("7 route PUT racing a delete")
    key = admin("alice")
    for i in range(rounds):
        name = f"race-{i}"
        first = await upload(api, "alice", name)
        second = await upload(api, "alice", name)
        tally.answer(first, refuse=False, what="race upload")
        tally.answer(second, refuse=False, what="race upload")
        body = {"variants": [{"adapter": f"{name}@1", "weight": 1}, {"adapter": f"{name}@2", "weight": 1}]}
        put, delete = await asyncio.gather(
            api.call("PUT", f"/v1/routes/{name}-route", key, json=body),
            api.call("DELETE", f"/v1/adapters/{name}@1", key),
        )
        tally.answer(put, refuse=None, what="racing route PUT")
        tally.answer(delete, refuse=None, what="racing delete")
        route = await api.call("GET", f"/v1/routes/{name}-route", key)
        if route.status_code == 200:
            for variant in route.json()["variants"]:
                exists = await api.call("GET", f"/v1/adapters/{variant['adapter']}", key)
                tally.tried()
                if exists.status_code != 200:
                    tally.failed(
                        "wrongly_accepted", f"round {i}: the route names {variant['adapter']}, which is gone"
                    )
            await api.call("DELETE", f"/v1/routes/{name}-route", key)


async def delete_while_streaming(api: Api, tally: Tally, rounds: int) -> None:
    tally.begin("delete while streaming (earlier pass)")
    for i in range(rounds):
        name = f"doomed-{i}"
        tally.answer(await upload(api, "alice", name), refuse=False, what="upload to delete")
        streams = [
            asyncio.create_task(
                api.stream("/v1/completions", user("alice"), {**LONG, "model": name, "max_tokens": 30})
            )
            for _ in range(3)
        ]
        await asyncio.sleep(0.3)
        tally.answer(
            await api.call("DELETE", f"/v1/adapters/{name}", admin("alice")),
            refuse=None,
            what="delete mid-stream",
        )
        for result in await asyncio.gather(*streams, return_exceptions=True):
            stream_ok(tally, result, "a stream of a deleted adapter", refuse=None)
        after = await api.call("POST", "/v1/completions", user("alice"), json={**SMALL, "model": name})
        tally.answer(after, refuse=True, what="a request after the delete")


async def streams_under_churn(api: Api, tally: Tally, stack: Stack, count: int) -> None:
    """`count` streams over three tenants, base model, adapters and a route, 40% cut (half before the
    first chunk, half after it), while uploads and route changes go on."""
    tally.begin("streams: 40% cut, uploads and route changes meanwhile")
    for tenant in ("alice", "bob"):
        tally.answer(await upload(api, tenant, "churn"), refuse=False, what="churn adapter")
        body = {"variants": [{"adapter": "churn@1", "weight": 1}]}
        tally.answer(
            await api.call("PUT", "/v1/routes/churn-route", admin(tenant), json=body),
            refuse=False,
            what="churn route",
        )
    rng = random.Random(3)
    stop = asyncio.Event()

    async def churn() -> None:
        i = 0
        while not stop.is_set():
            tenant = ("alice", "bob")[i % 2]
            response = await upload(api, tenant, "churn")
            tally.answer(response, refuse=False, what="an upload during the streams")
            if response.status_code == 201:
                version = response.json()["version"]
                body = {
                    "variants": [
                        {"adapter": f"churn@{version}", "weight": 3},
                        {"adapter": "churn@1", "weight": 1},
                    ]
                }
                put = await api.call("PUT", "/v1/routes/churn-route", admin(tenant), json=body)
                tally.answer(put, refuse=False, what="a route change during the streams")
            i += 1
            await asyncio.sleep(0.5)

    def one(i: int):
        tenant = ("alice", "bob", "carol")[i % 3]
        model = rng.choice(["tiny", "churn", "churn-route"])
        roll = rng.random()
        body = {**SMALL, "model": model, "max_tokens": rng.randint(2, 8), "prompt": f"story {i}: once"}
        if roll < 0.2:
            return api.stream("/v1/completions", user(tenant), body, cut_before_first=True), tenant
        if roll < 0.4:
            return api.stream(
                "/v1/completions", user(tenant), {**body, "max_tokens": 12}, cut_after=1
            ), tenant
        path = "/v1/chat/completions" if i % 4 == 0 else "/v1/completions"
        if path != "/v1/completions":
            body = {
                "model": model,
                "messages": [{"role": "user", "content": body["prompt"]}],
                "max_tokens": body["max_tokens"],
            }
        return api.stream(path, user(tenant), body), tenant

    warm = [one(i)[0] for i in range(40)]
    await gather_bounded(warm, 32)
    rss_before = stack.server_rss_bytes()
    churner = asyncio.create_task(churn())
    calls = [one(i) for i in range(count)]
    results = await gather_bounded((c for c, _ in calls), 48)
    stop.set()
    await churner
    for (_, tenant), result in zip(calls, results, strict=True):
        stream_ok(tally, result, f"{tenant}'s stream", refuse=None if tenant == "carol" else False)
    tally.tried(len(warm))
    tally.streams += len(warm)
    await asyncio.sleep(2.0)
    rss_after = stack.server_rss_bytes()
    growth = (rss_after - rss_before) / 2**20
    tally.row().note(
        f"info: server RSS {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB over {count} streams"
    )
    if growth > 300:
        tally.failed("leaks", f"the server grew {growth:.0f} MiB over {count} streams")
    for tenant in ("alice", "bob"):
        usage = (await api.call("GET", "/v1/usage", admin(tenant))).json()
        if usage["running"] or usage["waiting"]:
            tally.failed(
                "leaks", f"{tenant} still has {usage['running']} running, {usage['waiting']} waiting"
            )


async def sigterm_mid_upload(api: Api, tally: Tally, stack: Stack) -> None:
    """SIGTERM while an upload's body arrives and streams run: the upload gets the 503 body, streams end
    with [DONE], and the server exits within its shutdown timeout."""
    tally.begin("SIGTERM mid-upload, drain (earlier pass + item 9)")
    streams = [
        asyncio.create_task(api.stream("/v1/completions", user("alice"), {**LONG, "max_tokens": 60}))
        for _ in range(4)
    ]
    host, port = api.base_url.removeprefix("http://").split(":")
    config = UPLOAD_FILES["good"][0]
    padding = 600_000  # adapter_config.json padded with spaces (still valid JSON, under its 1 MiB limit)
    boundary = "sigterm"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nlate\r\n--{boundary}\r\n'
        f'Content-Disposition: form-data; name="files"; filename="adapter_config.json"\r\n\r\n'
    ).encode()

    def slow_upload() -> bytes:
        """The body arrives at 32 KB/s, ahead of the body timeout's rate, so it is still arriving when the
        drain's timeout ends and the server must answer it."""
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                f"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin('bob')}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                f"Content-Length: {len(head) + len(config) + padding + 200}\r\n\r\n".encode()
                + head
                + config
            )
            sock.settimeout(0.25)
            answer = b""
            start = time.monotonic()
            signalled = False
            while time.monotonic() - start < 25:
                if not signalled and time.monotonic() - start > 1.0:
                    stack.server.terminate()
                    signalled = True
                try:
                    sock.sendall(b" " * 8192)
                except OSError:
                    pass
                try:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                    if b"}}" in answer:
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            return answer

    await asyncio.sleep(0.5)
    answer = (await asyncio.to_thread(slow_upload)).decode(errors="replace")
    tally.tried()
    status_line = answer.split("\r\n", 1)[0]
    if " 5" in status_line and " 503 " not in status_line:
        tally.failed("server_errors", f"an upload cut by SIGTERM: {status_line}")
    elif " 503 " in status_line and '"server_shutting_down"' not in answer:
        tally.failed("other", f"an upload cut by SIGTERM: 503 without its body: {answer[-200:]}")
    for result in await asyncio.gather(*streams, return_exceptions=True):
        stream_ok(tally, result, "a stream during SIGTERM", refuse=None)
    try:
        code = await asyncio.to_thread(stack.server.process.wait, 30)
    except Exception:
        tally.failed("stalls", "the server did not exit within 30 s of SIGTERM")
        return
    tally.row().note(f"info: exit status {code} after SIGTERM; upload answer {status_line!r}")


async def kill_core(api: Api, tally: Tally, stack: Stack) -> None:
    """kill -9 of the engine core: streams end with an error event and [DONE], new requests get 503
    engine_dead with OpenAI's body, and the server exits with every child gone."""
    tally.begin("kill -9 of the engine core (earlier pass)")
    streams = [
        asyncio.create_task(api.stream("/v1/completions", user("bob"), {**LONG, "max_tokens": 80}))
        for _ in range(4)
    ]
    await asyncio.sleep(1.0)
    core = stack.engine_core()
    children = psutil.Process(stack.server.process.pid).children(recursive=True)
    os.kill(core.pid, signal.SIGKILL)
    await asyncio.sleep(1.0)
    for result in await asyncio.gather(*streams, return_exceptions=True):
        stream_ok(tally, result, "a stream when the core died", refuse=None, error_ok=True)
    for _ in range(5):
        try:
            response = await api.call("POST", "/v1/completions", user("bob"), json=SMALL)
        except httpx.HTTPError:
            tally.tried()
            break  # the server already exited: also fine
        tally.answer(response, refuse=None, what="a request after the core died", unavailable_ok=True)
        if response.status_code == 200:
            tally.failed("other", "a request was answered 200 after the core died")
    try:
        await asyncio.to_thread(stack.server.process.wait, 40)
    except Exception:
        tally.failed("stalls", "the server did not exit within 40 s of its core's death")
    await asyncio.sleep(1.0)
    alive = [p.pid for p in children if p.is_running() and p.status() != "zombie"]
    if alive:
        tally.failed("leaks", f"processes left after the server exited: {alive}")


def files_of(folder) -> tuple[bytes, bytes]:
    return (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()
