"""A `loraserve serve` subprocess on a free loopback port, for the end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 480.0  # the demo model converts on first start; shared CI machines can be slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loraserve_command() -> list[str]:
    """The installed console script next to this interpreter, else the module (same code). A script whose
    interpreter is gone (a venv shared and reinstalled from elsewhere) counts as none."""
    script = Path(sys.executable).parent / "loraserve"
    if script.exists():
        interpreter = script.read_bytes().split(b"\n", 1)[0].removeprefix(b"#!").strip().split(b" ")[0]
        if Path(interpreter.decode(errors="replace")).exists():
            return [str(script)]
    return [sys.executable, "-m", "loraserve.cli"]


class ServerProcess:
    def __init__(self, workdir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"  # /metrics is served there only
        self.log_path = workdir / f"server-{self.port}.log"
        command = [
            *loraserve_command(),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--state-dir",
            str(workdir / "state"),
            "--device",
            "cpu",
            *args,
        ]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT, env=environment
        )

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until /ready is 200; `seen_while_starting` collects the (/health, /ready) statuses met on the way."""
        deadline = time.monotonic() + timeout_s
        self.seen_while_starting: set[tuple[int, int]] = set()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=1.0).status_code
                ready = httpx.get(f"{self.url}/ready", timeout=1.0).status_code
                self.seen_while_starting.add((health, ready))
                if ready == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready within {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


def tiny_server_args(model_dir: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "128",
        "--block-size",
        "4",
        "--cpu-kv-cache-space",
        "0.01",
        "--max-loras",
        "2",
        *extra,
    ]
