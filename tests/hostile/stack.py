"""What the hostile-tenant probe runs against, all on loopback: a real redis-server, moto's S3 server in
a process of its own, a tiny random Llama on the CPU with a real tokenizer, PEFT adapters for it, a keys
file for three tenants, and `loraserve serve` from this checkout (tests/e2e/server_process.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import psutil
from app_fixtures import make_text_model
from factories import make_adapter
from server_process import ServerProcess, free_port, tiny_server_args

BUCKET = "hostile-probe"
# tenant -> (admin key, user key, extra key fields): carol has a token rate and a concurrency cap
TENANTS = {
    "alice": ("sk-probe-alice-admin", "sk-probe-alice-user", {}),
    "bob": ("sk-probe-bob-admin", "sk-probe-bob-user", {}),
    "carol": (
        "sk-probe-carol-admin",
        "sk-probe-carol-user",
        {"max_tokens_per_minute": 2000, "max_concurrent_requests": 4},
    ),
}
TOKENS_PER_MINUTE = 2000
CAROL_CONCURRENCY = 4
MAX_ROUTES = 20
HEADER_TIMEOUT_S = 4
BODY_TIMEOUT_S = 6
AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def admin(tenant: str) -> str:
    return TENANTS[tenant][0]


def user(tenant: str) -> str:
    return TENANTS[tenant][1]


def _wait_port(port: int, process: subprocess.Popen, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited at start ({process.returncode})")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s} s")


@dataclass
class Stack:
    root: Path
    model_dir: Path
    adapter_dirs: list[Path]  # rank-8 q/v adapters, different seeds (tests/hostile_adapters.py's `qv`)
    allowed_dir: Path  # --allowed-lora-paths
    tmp_dir: Path  # the server's TMPDIR: where uploads stage
    redis_url: str
    s3_url: str
    server: ServerProcess | None = None
    children: list[subprocess.Popen] = field(default_factory=list)

    @property
    def secrets(self) -> list[str]:
        """Strings no error body may carry: the server's folders."""
        return [str(self.root), str(self.tmp_dir), "/tmp/", str(self.root / "state")]

    def server_args(self) -> list[str]:
        adapter_bytes = sum(f.stat().st_size for f in self.adapter_dirs[0].iterdir())
        return tiny_server_args(
            self.model_dir,
            "--api-keys",
            str(self.root / "keys.json"),
            "--config-store",
            self.redis_url,
            "--adapter-store",
            f"s3://{BUCKET}/adapters",
            "--allowed-lora-paths",
            str(self.allowed_dir),
            "--max-routes-per-tenant",
            str(MAX_ROUTES),
            "--adapter-cache-max-bytes",
            str(int(adapter_bytes * 2.5)),  # room for two adapters: the rest must be evicted, never refused
            "--http-header-timeout",
            str(HEADER_TIMEOUT_S),
            "--http-body-timeout",
            str(BODY_TIMEOUT_S),
            "--shutdown-timeout",
            "8",
            "--max-num-seqs",
            "64",
        )

    def start_server(self) -> ServerProcess:
        env = {**AWS, "AWS_ENDPOINT_URL": self.s3_url, "TMPDIR": str(self.tmp_dir), "OMP_NUM_THREADS": "1"}
        workdir = self.root / f"server-{time.monotonic_ns()}"
        workdir.mkdir()
        server = ServerProcess(workdir, self.server_args(), env)
        server.wait_ready(timeout_s=300)
        self.server = server
        return server

    def server_rss_bytes(self) -> int:
        """The server and every process under it (the engine core, loaders)."""
        if self.server is None or self.server.process.poll() is not None:
            return 0
        top = psutil.Process(self.server.process.pid)
        total = 0
        for process in [top, *top.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def engine_core(self) -> psutil.Process | None:
        top = psutil.Process(self.server.process.pid)
        cores = [p for p in top.children(recursive=False) if "resource_tracker" not in " ".join(p.cmdline())]
        return max(cores, key=lambda p: p.memory_info().rss) if cores else None

    def staged_files(self) -> list[str]:
        """Files under the server's TMPDIR (uploads stage there)."""
        return [str(p.relative_to(self.tmp_dir)) for p in self.tmp_dir.rglob("*") if p.is_file()]

    def staged_bytes(self) -> int:
        total = 0
        for path in self.tmp_dir.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:
                pass
        return total

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        for child in self.children:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait(timeout=10)


def build(root: Path, num_adapters: int) -> Stack:
    """Model, adapters, keys, Redis and moto up (the server is started by the caller)."""
    root.mkdir(parents=True, exist_ok=True)
    model_dir = make_text_model(root / "model")
    adapters = [
        make_adapter(
            model_dir, root / f"adapter-{i}", seed=i, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        )
        for i in range(num_adapters)
    ]
    allowed = root / "allowed"
    shutil.copytree(adapters[0], allowed / "good")
    keys = {}
    for tenant, (admin_key, user_key, extra) in TENANTS.items():
        keys[admin_key] = {"tenant": tenant, "role": "admin", **extra}
        keys[user_key] = {"tenant": tenant, "role": "user", **extra}
    (root / "keys.json").write_text(json.dumps(keys))
    tmp_dir = root / "server-tmp"
    tmp_dir.mkdir()
    children: list[subprocess.Popen] = []
    try:
        redis_port, s3_port = free_port(), free_port()
        (root / "redis").mkdir()
        redis = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(root / "redis"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        children.append(redis)
        _wait_port(redis_port, redis, "redis-server")
        moto = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from moto.server import main; main(sys.argv[1:])",
                "-H",
                "127.0.0.1",
                "-p",
                str(s3_port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **AWS},
        )
        children.append(moto)
        _wait_port(s3_port, moto, "moto_server")
        s3_url = f"http://127.0.0.1:{s3_port}"
        os.environ.update(AWS)
        boto3.client("s3", endpoint_url=s3_url).create_bucket(Bucket=BUCKET)
    except BaseException:
        for child in children:
            child.kill()
        raise
    return Stack(
        root,
        model_dir,
        adapters,
        allowed,
        tmp_dir,
        f"redis://127.0.0.1:{redis_port}/0",
        s3_url,
        children=children,
    )
