"""A `--api-server-count 2` server whose start fails leaves nothing behind: its shared runtime folder
(under /dev/shm, named in its log) is removed and every process it started is gone.

Two failures: the API port is taken (the supervisor fails before it starts the core), and the model's
weights are unreadable (the core dies after the front ends started). The processes are found by a
marker in their environment (every child inherits it), so the check holds whoever their parent is now.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from processes import kill_quietly, wait_gone  # noqa: E402
from server_process import free_port, loraserve_command, tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow
EXIT_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("e2e-failed-start") / "model")


def marked_pids(marker: str) -> list[int]:
    """The live processes whose environment holds `marker`."""
    pids = []
    needle = f"LORASERVE_TEST_MARK={marker}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pids.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def run_failing(tmp_path: Path, model_dir: Path, port: int) -> tuple[int, str, str]:
    """Start the server, wait for its exit (bounded); (exit code, log, marker)."""
    marker = uuid.uuid4().hex
    log_path = tmp_path / "server.log"
    command = [
        *loraserve_command(),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(free_port()),
        "--state-dir",
        str(tmp_path / "state"),
        "--device",
        "cpu",
        *tiny_server_args(model_dir, "--api-server-count", "2"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LORASERVE_TEST_MARK": marker}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = process.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    return code, log_path.read_text(errors="replace"), marker


def check_nothing_left(code: int, log: str, marker: str) -> None:
    leftovers = marked_pids(marker)
    try:
        assert code != 0, log[-4000:]
        folders = re.findall(r"shared runtime folder: (\S+)", log)
        assert len(folders) == 1, log[-4000:]  # made once, so there was something to remove
        assert not Path(folders[0]).exists(), f"{folders[0]} outlived the failed start"
        assert all(wait_gone(pid, 20) for pid in leftovers), "a process of the server outlived it"
    finally:
        for pid in leftovers:
            kill_quietly(pid)


def test_a_taken_port_leaves_no_runtime_folder(tmp_path, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, log, marker = run_failing(tmp_path, model_dir, taken.getsockname()[1])
    check_nothing_left(code, log, marker)


def test_a_core_that_cannot_load_leaves_no_runtime_folder_nor_process(tmp_path, model_dir):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for item in model_dir.iterdir():  # the config reads (the supervisor's checks pass); the weights do not
        if item.is_file():
            data = b"not safetensors" if item.suffix == ".safetensors" else item.read_bytes()
            (broken / item.name).write_bytes(data)
    code, log, marker = run_failing(tmp_path, broken, free_port())
    assert code == 1, log[-4000:]
    check_nothing_left(code, log, marker)
