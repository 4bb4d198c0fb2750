"""`loraserve serve --api-server-count 2`: two front-end processes behind one port and one engine core.

Connections spread over both processes; the concurrency and token limits hold for the replica, not per
process; /metrics adds both processes up, whichever answers; a route set through one process is what
the other serves, sticky users included; a killed front end is replaced and its leases freed; a killed
engine core ends every process's streams with an error event and the server exits 1. The test talks raw
HTTP/1.1 over its own sockets, so it knows which process holds each connection (/proc).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from factories import make_adapter  # noqa: E402
from processes import child_pids, connection_owner, kill_quietly, process_group, wait_gone  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow
ADMIN, CAPPED, METERED = "sk-admin-0123456789", "sk-capped-0123456789", "sk-metered-0123456789"
KEYS = {
    ADMIN: {"tenant": "default", "role": "admin"},
    CAPPED: {"tenant": "capped", "role": "user", "max_concurrent_requests": 2},
    METERED: {"tenant": "metered", "role": "user", "max_tokens_per_minute": 100},
}
LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


class Connection:
    """One keep-alive HTTP/1.1 connection (raw: the test needs its port to find the process holding it)."""

    def __init__(self, port: int) -> None:
        self.server_port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.port = self.sock.getsockname()[1]
        self.reader = self.sock.makefile("rb")
        self.owner: int | None = None
        self.opened = time.monotonic()

    def send(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        headers = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(data)}"]
        if body is not None:
            headers.append("Content-Type: application/json")
        if key is not None:
            headers.append(f"Authorization: Bearer {key}")
        self.sock.sendall(("\r\n".join(headers) + "\r\n\r\n").encode() + data)

    def head(self) -> tuple[int, dict[str, str]]:
        status = int(self.reader.readline().split()[1])
        headers = {}
        while (line := self.reader.readline().strip()) != b"":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def body(self, headers: dict[str, str]) -> bytes:
        if "content-length" in headers:
            return self.reader.read(int(headers["content-length"]))
        chunks = []
        while (size := int(self.reader.readline().strip() or b"0", 16)) > 0:
            chunks.append(self.reader.read(size))
            self.reader.readline()
        self.reader.readline()
        return b"".join(chunks)

    def call(self, method: str, path: str, body: dict | None = None, key: str | None = None):
        self.send(method, path, body, key)
        status, headers = self.head()
        return status, headers, self.body(headers)

    def events(self) -> list[str]:
        """The rest of a streamed response's `data:` events (until [DONE] or the connection closes)."""
        events = []
        try:
            while size := int(self.reader.readline().strip() or b"0", 16):
                chunk = self.reader.read(size).decode()
                self.reader.readline()
                events += [line[6:] for line in chunk.splitlines() if line.startswith("data: ")]
                if events and events[-1] == "[DONE]":
                    self.reader.readline()
                    self.reader.readline()
                    break
        except (OSError, ValueError):  # cut: the process holding it died
            pass
        return events

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def front_ends(server_pid: int) -> list[int]:
    """The server's front-end processes: its children in process groups of their own (the core is in
    the server's group)."""
    return sorted(pid for pid in child_pids(server_pid) if process_group(pid) == pid)


class Pool:
    """Connections to a server's port, by the process that holds each: `to(pid)` opens connections (each
    says GET /health) until one lands on that process. The kernel hands each new connection to whichever
    process accepts first, so a few tries find any of them. Use a connection at once: the server closes
    idle ones after 5 s."""

    def __init__(self, port: int, pids: list[int]) -> None:
        self.port, self.pids = port, list(pids)
        self._spare: dict[int, list[Connection]] = {}

    def to(self, pid: int) -> Connection:
        for _ in range(200):
            spare = [c for c in self._spare.get(pid, []) if time.monotonic() - c.opened < 2.0]
            if spare:
                self._spare[pid] = spare[:-1]
                return spare[-1]
            conn = Connection(self.port)
            status, _, _ = conn.call("GET", "/health")
            assert status == 200
            conn.owner = connection_owner(self.port, conn.port, self.pids)
            self._spare.setdefault(conn.owner, []).append(conn)
        raise AssertionError(f"no connection landed on process {pid} in 200 tries")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("e2e-api-servers") / "model")


def start_two(start_server, tmp_path, model_dir, *extra: str):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    return start_server(
        tiny_server_args(model_dir, "--api-server-count", "2", "--api-keys", str(keys), *extra)
    )


def test_two_front_ends_share_limits_metrics_and_routes_and_outlive_a_death(
    start_server, tmp_path, model_dir
):
    adapters = [make_adapter(model_dir, tmp_path / f"a{i}", seed=i, r=4) for i in (1, 2)]
    server = start_two(
        start_server, tmp_path, model_dir, "--lora-modules", *(f"a{i}={p}" for i, p in zip((1, 2), adapters))
    )
    pids = front_ends(server.process.pid)
    assert len(pids) == 2, child_pids(server.process.pid)
    api = Pool(server.port, pids)
    a, b = pids

    # /ready was 200, so each front end had run its own serving warm-up (ops/serving_warmup.py).
    log = server.log_path.read_text(errors="replace")
    for slot in (0, 1):
        assert f"serving warm-up of front-end process {slot} done: 4 requests" in log, log[-4000:]

    # Concurrency cap 2 for the replica: one stream on each process, then both processes refuse. The
    # streams run as long as the context allows (11 prompt tokens of 128), so they still hold their
    # slots while the refusals are asked for on a loaded 2-core machine.
    streams = [api.to(a), api.to(b)]
    for conn in streams:
        conn.send("POST", "/v1/completions", {**LONG, "max_tokens": 110, "stream": True}, CAPPED)
        assert conn.head()[0] == 200
    for pid in (a, b):  # (a refused request's connection is not reused: the server may close it)
        status, headers, body = api.to(pid).call("POST", "/v1/completions", LONG, CAPPED)
        assert status == 429 and "limit is 2" in json.loads(body)["error"]["message"], body
    assert all(conn.events()[-1] == "[DONE]" for conn in streams)
    assert api.to(b).call("POST", "/v1/completions", {**LONG, "max_tokens": 2}, CAPPED)[0] == 200

    # 100 tokens per minute for the replica: 4 prompt + 60 held through one process leaves too few for
    # the same again through the other.
    short = {"model": "tiny", "prompt": "Hello world", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    assert api.to(a).call("POST", "/v1/completions", short, METERED)[0] == 200
    status, _, body = api.to(b).call("POST", "/v1/completions", short, METERED)
    assert status == 429 and "tokens per minute" in json.loads(body)["error"]["message"], body

    # A route set through one process is what the other serves; sticky users see one variant anywhere.
    route = {"variants": [{"adapter": "a1", "weight": 50}, {"adapter": "a2", "weight": 50}], "sticky": "user"}
    assert api.to(a).call("PUT", "/v1/routes/split", route, ADMIN)[0] in (200, 201)
    ask = {"model": "split", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    users = [f"user-{i}" for i in range(8)]

    def variant(pid: int, user: str) -> str:
        answer = api.to(pid).call("POST", "/v1/completions", {**ask, "user": user}, ADMIN)
        return answer[1]["x-loraserve-variant"]

    seen = {pid: [variant(pid, user) for user in users] for pid in pids}
    assert seen[a] == seen[b] and len(set(seen[a])) == 2, seen
    only_a2 = {"variants": [{"adapter": "a2", "weight": 1}], "sticky": "user"}
    assert api.to(a).call("PUT", "/v1/routes/split", only_a2, ADMIN)[0] in (200, 201)
    deadline = time.monotonic() + 10  # the other process's cached route is dropped by the change event
    while not (served := variant(b, users[0])).startswith("a2") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served.startswith("a2")

    # /metrics sums both processes, whichever answers the scrape.
    scrapers = Pool(server.metrics_port, pids)
    texts = []
    for pid in pids:
        status, _, body = scrapers.to(pid).call("GET", "/metrics")
        assert status == 200
        texts.append(body.decode())
    for name in (
        "vllm:e2e_request_latency_seconds_count",
        'loraserve_tenant_rate_limited_total{limit="concurrency"',
    ):
        assert metric(texts[0], name) == metric(texts[1], name), name
    assert metric(texts[0], 'loraserve_tenant_rate_limited_total{limit="concurrency",tenant="capped"}') == 2
    # two streams, one capped and one metered request, each user through both processes, the route check
    assert metric(texts[0], "vllm:e2e_request_latency_seconds_count") >= 2 + 1 + 1 + 2 * len(users) + 1

    # A killed front end: its stream is cut, the core frees its request, its lease is released, and a
    # new process takes its slot.
    cut = api.to(a)
    cut.send("POST", "/v1/completions", {**LONG, "max_tokens": 100, "stream": True}, CAPPED)
    assert cut.head()[0] == 200
    os.kill(a, signal.SIGKILL)
    assert "[DONE]" not in cut.events()
    deadline = time.monotonic() + 180
    while len(new := front_ends(server.process.pid)) < 2 or a in new:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    server.wait_ready()  # /ready waits for every front end
    again = Pool(server.port, new)
    streams = [again.to(pid) for pid in new]
    for conn in streams:  # both admitted: the dead process's lease is gone with it
        conn.send("POST", "/v1/completions", {**LONG, "max_tokens": 4, "stream": True}, CAPPED)
        assert conn.head()[0] == 200
    for conn in streams:
        assert conn.events()[-1] == "[DONE]"
    whole_log = server.log_path.read_text(errors="replace")  # log() is the tail: the access log is long
    assert "front-end process 0" in whole_log and "restarted" in whole_log

    server.terminate()
    assert server.process.wait(timeout=120) == 0, server.log()


def test_a_dead_engine_core_ends_every_front_ends_streams(start_server, tmp_path, model_dir):
    server = start_two(start_server, tmp_path, model_dir)
    children = child_pids(server.process.pid)
    pids = front_ends(server.process.pid)
    (core,) = [pid for pid in children if pid not in pids and b"spawn_main" in _cmdline(pid)]
    try:
        api = Pool(server.port, pids)
        conns = [api.to(pid) for pid in pids]
        for conn in conns:
            conn.send("POST", "/v1/completions", {**LONG, "max_tokens": 100, "stream": True}, ADMIN)
            assert conn.head()[0] == 200
        os.kill(core, signal.SIGKILL)
        for conn in conns:
            events = conn.events()
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead", events
        assert server.process.wait(timeout=120) == 1, server.log()
        assert all(wait_gone(pid, 20) for pid in children), "a child of the server outlived it"
    finally:
        for pid in children:
            kill_quietly(pid)
