"""SIGTERM during a stream: the server drains, the stream still ends with an event and `data: [DONE]`,
and the process exits cleanly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow


def test_sigterm_ends_a_running_stream_properly(start_server, tmp_path):
    model_dir = make_text_model(tmp_path / "model")
    # No grace period: the stream is certainly still running when the drain gives up on it.
    server = start_server(tiny_server_args(model_dir, "--shutdown-timeout", "0"))
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 110,  # with the 11-token prompt, within the 128-token context
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: ") :])
            if len(events) == 2:
                server.terminate()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert len(events) < 120
    assert server.process.wait(timeout=60) == 0, server.log()
    assert "draining" in server.log()
