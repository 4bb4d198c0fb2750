"""`loraserve serve` runs the engine core in a process of its own: kill -9 of the core mid-stream ends
the stream with an error event and the server exits non-zero; SIGTERM or kill -9 of the server leaves
no process behind."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from processes import child_pids, kill_quietly, wait_gone  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow
BODY = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 110,  # with the 11-token prompt, within the 128-token context
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("e2e-core") / "model")


def core_pid(server_pid: int) -> int:
    """The server's engine core: its one child started by multiprocessing's spawn."""
    (pid,) = [pid for pid in child_pids(server_pid) if b"spawn_main" in _cmdline(pid)]
    return pid


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_killed_core_ends_the_stream_with_an_error_and_the_server_exits_non_zero(start_server, model_dir):
    server = start_server(tiny_server_args(model_dir))
    children = child_pids(server.process.pid)
    core = core_pid(server.process.pid)
    try:
        events = []
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 2:
                        os.kill(core, signal.SIGKILL)
        assert events[-1] == "[DONE]" and len(events) < 120
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and "engine stopped" in error["message"]
        assert server.process.wait(timeout=60) == 1, server.log()
        assert "engine core process exited unexpectedly (killed by SIGKILL)" in server.log()
        assert all(wait_gone(pid, 10) for pid in children), "a child of the server outlived it"
    finally:
        for pid in children:
            kill_quietly(pid)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_no_process_outlives_the_server(start_server, model_dir, how):
    server = start_server(tiny_server_args(model_dir))
    children = child_pids(server.process.pid)
    assert core_pid(server.process.pid) in children
    try:
        if how == "sigterm":
            server.terminate()
            assert server.process.wait(timeout=60) == 0, server.log()
        else:
            server.process.kill()
            server.process.wait(timeout=10)
        assert all(wait_gone(pid, 15) for pid in children), "a child of the server outlived it"
    finally:
        for pid in children:
            kill_quietly(pid)
