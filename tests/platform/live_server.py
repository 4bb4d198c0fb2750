"""The app under the server's own uvicorn setup (`loraserve serve`: DrainingServer, bounded h11 protocol)
on a free loopback port, in a thread, for tests that need real sockets: slow clients, SIGTERM mid-upload."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from litestar import Litestar
from loraserve.app import shutdown_of
from loraserve.http_server import DrainingServer
from loraserve.ops.http_timeouts import bounded_h11_protocol


@dataclass
class LiveServer:
    server: DrainingServer
    port: int
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self, timeout_s: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)


@contextlib.contextmanager
def live_server(
    app: Litestar, *, header_timeout_s: float = 20.0, body_timeout_s: float = 30.0, body_min_rate: int = 16384
) -> Iterator[LiveServer]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        timeout_graceful_shutdown=5,
        http=bounded_h11_protocol(header_timeout_s, body_timeout_s, body_min_rate),
    )
    server = DrainingServer(config, shutdown_of(app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="live-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    live = LiveServer(server, sock.getsockname()[1], thread)
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def read_response(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    sock.settimeout(timeout_s)
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
