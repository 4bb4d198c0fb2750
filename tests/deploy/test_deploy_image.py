"""The CPU image, built and run for real where a Docker daemon answers (skipped elsewhere).

Run as docs/OPERATIONS.md says (a keys file, --stop-timeout longer than the drain), with a read-only
root and every capability dropped: /health answers while the demo model converts and loads, /ready turns
200, a keyed chat completion answers (and an unkeyed one is refused: no open mode), and `docker stop`
with a stream open ends that stream with its final event and `data: [DONE]`, the container exiting 0
(not Docker's SIGKILL, 137).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time

import httpx
import pytest
from deploy_files import REPO

pytestmark = pytest.mark.slow
BUILD_TIMEOUT_S = 1800  # torch's CPU wheel and the rest, from the package index
READY_TIMEOUT_S = 600
KEY = "sk-image-test"


def _docker() -> str:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client on this machine")
    info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=60)
    if info.returncode != 0:
        pytest.skip("no Docker daemon answers here (docker info failed)")
    return docker


@pytest.fixture(scope="module")
def cpu_image():
    docker = _docker()
    tag = "loraserve:test-cpu"
    build = subprocess.run(
        [docker, "build", "-f", "deploy/Dockerfile", "--build-arg", "VARIANT=cpu", "-t", tag, "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return docker, tag


@pytest.fixture
def container(cpu_image, tmp_path):
    docker, tag = cpu_image
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(f"{KEY}: {{tenant: default, role: admin}}\n")
    keys.chmod(0o644)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    name = f"loraserve-image-test-{port}"
    command = [
        docker, "run", "-d", "--name", name, "--stop-timeout", "90", "-p", f"127.0.0.1:{port}:8000",
        "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--tmpfs", "/tmp", "--tmpfs", "/var/lib/loraserve:uid=10001,gid=10001,mode=0755",
        "-v", f"{keys}:/etc/loraserve/api-keys.yaml:ro", "-e", "LORASERVE_API_KEYS=/etc/loraserve/api-keys.yaml",
        # A short drain, so the stream below is still running when it ends.
        "-e", "LORASERVE_SHUTDOWN_TIMEOUT=3", "-e", "LORASERVE_MAX_MODEL_LEN=512",
        "-e", "LORASERVE_CPU_KV_CACHE_SPACE=0.1", "-e", "LORASERVE_METRICS_PORT=off",
        tag,
    ]  # fmt: skip
    started = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        yield docker, name, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([docker, "rm", "-f", "-v", name], capture_output=True, timeout=120)


def _logs(docker: str, name: str) -> str:
    result = subprocess.run(
        [docker, "logs", "--tail", "60", name], capture_output=True, text=True, timeout=60
    )
    return result.stdout + result.stderr


def _wait_ready(docker: str, name: str, base: str) -> set[tuple[int, int]]:
    seen: set[tuple[int, int]] = set()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{base}/health", timeout=2).status_code
            ready = httpx.get(f"{base}/ready", timeout=2).status_code
            seen.add((health, ready))
            if ready == 200:
                return seen
        except httpx.TransportError:
            state = subprocess.run(
                [docker, "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True
            )
            assert state.stdout.strip() == "true", f"the container stopped:\n{_logs(docker, name)}"
        time.sleep(1)
    pytest.fail(f"not ready within {READY_TIMEOUT_S} s:\n{_logs(docker, name)}")


def test_the_cpu_image_serves_and_stops_gracefully(container):
    docker, name, base = container
    seen = _wait_ready(docker, name, base)
    assert (200, 503) in seen, f"/health and /ready did not answer during the load: {seen}"
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Name three colours."}],
    }
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120).status_code == 401
    answer = httpx.post(
        f"{base}/v1/chat/completions", json={**chat, "max_tokens": 16}, headers=auth, timeout=120
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"], answer.text
    assert "this is the CPU image" in _logs(docker, name)

    events: list[str] = []
    first_token = threading.Event()

    def stream() -> None:
        body = {**chat, "stream": True, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=auth, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    first_token.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(120), "the stream sent nothing"
    stop = subprocess.run([docker, "stop", name], capture_output=True, text=True, timeout=150)
    reader.join(timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert events[-1] == "[DONE]", events[-3:]
    final = json.loads(events[-2])
    assert "error" in final or final["choices"][0]["finish_reason"], final  # an end, not a cut
    code = subprocess.run(
        [docker, "inspect", "-f", "{{.State.ExitCode}}", name], capture_output=True, text=True
    )
    assert code.stdout.strip() == "0", f"exit code {code.stdout.strip()}:\n{_logs(docker, name)}"
