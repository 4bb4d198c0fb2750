"""The served half of benchmarks/serve.py: a `loraserve serve` subprocess, and streaming HTTP clients
spread over a few client processes (one Python process parsing every SSE event of 128 streams would
measure the client, not the server).

Clock: time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so
the client processes' timestamps compare with each other and with the parent's.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Sample:
    """One streamed request, as its client saw it."""

    sent: float
    first: float | None  # first chunk with content
    last: float | None
    num_tokens: int
    error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m loraserve.cli serve ...` from this checkout, on a free loopback port."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environment = {**os.environ, **(env or {})}
        # The checkout first, then whatever the caller had (e.g. a folder of wheels installed with --target).
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        environment["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "platform"), *inherited])
        environment.pop("TRITON_CACHE_DIR", None)  # the server keeps its kernels under --state-dir
        self.log_path = log_path
        self._log = log_path.open("wb")
        command = [
            sys.executable,
            "-m",
            "loraserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.process = subprocess.Popen(
            [*command, *args], stdout=self._log, stderr=subprocess.STDOUT, env=environment, cwd=REPO
        )

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /ready said 200; RuntimeError with the log's tail if it exited or took too long."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


@contextmanager
def serving(
    args: list[str], log_path: Path, startup_timeout_s: float, env: dict[str, str] | None = None
) -> Iterator[tuple[Server, float]]:
    """A `Server` with `args`, once /ready is 200: (server, seconds it took). Stopped on the way out; its
    log's tail is printed when the start or the block fails, or when it exits with an error."""
    server = Server(args, log_path, env)
    try:
        yield server, server.wait_ready(startup_timeout_s)
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        code = server.stop()
        if code not in (0, None):
            print(f"the server exited with {code}:\n{server.log_tail()}", file=sys.stderr)


def drive(
    url: str,
    bodies: list[dict],
    num_processes: int,
    concurrency: int | None = None,
    *,
    cpus: frozenset[int] | None = None,
    busy: list[float] | None = None,
) -> tuple[list[Sample], float, float]:
    """Send the bodies as streaming /v1/completions requests, spread over `num_processes` client
    processes: every one at once, or at most `concurrency` in flight (each process keeps its share of
    the streams busy, starting its next request as one ends). Returns (samples in the order of `bodies`,
    start, end) on the perf_counter clock. `cpus`: the client processes run there (off the engine core's
    CPUs); `busy`, if given, receives each client process's CPU time over its wall time while it sent and
    read (near 1.0 means that client, not the server, set the pace)."""
    num_processes = max(1, min(num_processes, len(bodies), concurrency or len(bodies)))
    shares = [bodies[i::num_processes] for i in range(num_processes)]
    streams = [None] * num_processes
    if concurrency is not None:  # split the streams over the processes: 128 over 8 is 16 each
        streams = [
            concurrency // num_processes + (i < concurrency % num_processes) for i in range(num_processes)
        ]
    context = multiprocessing.get_context("spawn")
    jobs = [(url, share, limit) for share, limit in zip(shares, streams) if share]
    # Every process starts, imports and connects before any sends: a fixed head start was not always
    # enough on a busy machine, and a process starting late stretched the run (min send to last chunk).
    ready = context.Barrier(len(jobs))
    with context.Pool(len(jobs), initializer=_share_barrier, initargs=(ready, cpus)) as pool:
        parts = pool.starmap(_client_process, jobs)
    samples = [None] * len(bodies)
    for i, (part, _) in enumerate(parts):  # process i sent bodies i, i + n, i + 2n, ...
        samples[i :: len(jobs)] = part
    if busy is not None:
        busy.extend(share for _, share in parts)
    # From the first send (a slow process start may delay it past start_at) to the last chunk.
    return samples, min(s.sent for s in samples), max((s.last or s.sent) for s in samples)


_READY = None  # the client processes' start barrier (set by the pool's initializer)
BARRIER_TIMEOUT_S = 120.0


def _share_barrier(barrier, cpus: frozenset[int] | None = None) -> None:
    global _READY
    _READY = barrier
    if cpus:
        os.sched_setaffinity(0, cpus)


def _client_process(url: str, bodies: list[dict], streams: int | None = None) -> tuple[list[Sample], float]:
    """(samples, this process's CPU time / wall time from its first send to its last chunk)."""
    samples = asyncio.run(_clients(url, bodies, streams))
    return samples, _CPU_SHARE


_CPU_SHARE = 0.0


async def _clients(url: str, bodies: list[dict], streams: int | None) -> list[Sample]:
    streams = len(bodies) if streams is None else streams
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        await client.get("/health")  # connection pool warm
        await asyncio.to_thread(_READY.wait, BARRIER_TIMEOUT_S)
        gate = asyncio.Semaphore(streams)

        async def one(body: dict) -> Sample:
            async with gate:
                return await _stream(client, body)

        global _CPU_SHARE
        wall, cpu = time.perf_counter(), time.process_time()
        samples = await asyncio.gather(*(one(body) for body in bodies))
        _CPU_SHARE = (time.process_time() - cpu) / max(1e-9, time.perf_counter() - wall)
        return samples


async def _stream(client: httpx.AsyncClient, body: dict) -> Sample:
    headers = body.get("__headers__")  # e.g. an API key: sent as headers, not in the body
    if headers is not None:
        body = {key: value for key, value in body.items() if key != "__headers__"}
    sent = time.perf_counter()
    first = last = None
    num_tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                return Sample(sent, None, None, 0, f"HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(sent, first, last, num_tokens, event["error"].get("message"))
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    last = time.perf_counter()
                    first = first or last
    except httpx.HTTPError as exc:
        return Sample(sent, first, last, num_tokens, f"{type(exc).__name__}: {exc}")
    return Sample(sent, first, last, num_tokens)
