"""Start the real server (`loraserve serve` under uvicorn) in a subprocess on a free loopback port."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_process import ServerProcess


@pytest.fixture
def start_server(tmp_path):
    servers: list[ServerProcess] = []

    def start(
        args: list[str], env: dict[str, str] | None = None, workdir: Path | None = None
    ) -> ServerProcess:
        server = ServerProcess(workdir or tmp_path, args, env)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()
