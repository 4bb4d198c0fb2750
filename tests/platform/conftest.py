"""A real redis-server on a free loopback port for the config store tests.

Missing redis-server skips the Redis tests on a developer machine but fails them in CI (CI is set),
where `make redis` must have installed it. Each test namespaces its keys with a fresh prefix, so one
server serves the whole session; tests that kill Redis start their own with `redis_server_factory`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from api_env import *  # noqa: F403 (the adapter/route API fixtures: api_env, peft_adapters, edit_adapter)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (apt-get install redis-server, or `make redis`)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it", pytrace=False)
        pytest.skip(message)
    return binary


class RedisServer:
    """One redis-server process; stop() kills it (SIGKILL, like a crash), start() brings it back on the same port.

    Append-only persistence with fsync on every write, so data written before a kill is there after a restart.
    """

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.folder),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--logfile",
            str(self.folder / "redis.log"),
        ]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._process.returncode}; see {self.folder / 'redis.log'}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)
        self._process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(_redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server_factory(tmp_path):
    """Start private servers a test may kill and restart; all are stopped at the end."""
    binary = _redis_binary()
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        server = RedisServer(binary, tmp_path / f"redis-{len(servers)}")
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()
