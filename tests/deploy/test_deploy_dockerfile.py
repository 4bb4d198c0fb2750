"""deploy/Dockerfile: hadolint clean, and the properties the platform relies on hold."""

from __future__ import annotations

import fnmatch
import json
import shlex
import subprocess

from deploy_files import (
    DEPLOY,
    DOCKERFILE,
    REPO,
    dockerfile_runtime_env,
    dockerfile_stages,
    instructions,
    tool,
)

# Anything that builds software; the runtime stage may install none of these. gcc and the libc and
# Python headers are the exception Triton forces (it compiles its kernel launchers at run time).
BUILD_TOOLS = {
    "build-essential",
    "g++",
    "make",
    "cmake",
    "ninja-build",
    "git",
    "clang",
    "python3-pip",
    "cuda-toolkit",
    "cuda-nvcc",
    "autoconf",
    "automake",
    "pkg-config",
}
TRITON_RUNTIME_NEEDS = {"gcc", "libc6-dev", "libpython3-dev"}


def apt_packages(stage: list[dict]) -> set[str]:
    """Packages named by `apt-get install` in a stage's RUN lines."""
    packages: set[str] = set()
    for run in instructions(stage, "RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def test_hadolint_passes():
    result = subprocess.run(
        [tool("hadolint"), "--no-color", "--config", str(DEPLOY / "hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_with_a_tool_free_runtime():
    stages = dockerfile_stages()
    assert len(stages) >= 2, "the venv is built in a builder stage"
    builder, runtime = stages[0], stages[-1]
    assert instructions(builder, "FROM")[0].endswith(" AS builder")
    installed = apt_packages(runtime)
    assert installed, "the runtime stage installs python3 and Triton's compiler"
    assert not installed & BUILD_TOOLS, f"build tools in the final stage: {installed & BUILD_TOOLS}"
    assert installed - {"python3"} <= TRITON_RUNTIME_NEEDS, f"unexpected runtime packages: {installed}"
    # The final stage copies the venv and nothing from the build context (no sources, no tests).
    copies = instructions(runtime, "COPY")
    assert copies and all(c.startswith("--from=builder ") for c in copies)
    assert all("pip install" not in run for run in instructions(runtime, "RUN"))


def test_runtime_runs_as_a_numeric_non_root_user():
    runtime = dockerfile_stages()[-1]
    uid = next(v.split("=", 1)[1] for v in instructions(runtime, "ARG") if v.startswith("UID="))
    assert uid.isdigit() and int(uid) >= 1000
    users = instructions(runtime, "USER")
    assert users == ["${UID}:${UID}"]


def test_settings_and_entrypoint():
    env = dockerfile_runtime_env()
    assert env["PYTHONSAFEPATH"] == "1"
    assert env["LORASERVE_HOST"] == "0.0.0.0", "inside a container the server must listen beyond loopback"
    assert env["HF_HOME"] == "/var/cache/huggingface"
    runtime = dockerfile_stages()[-1]
    assert json.loads(instructions(runtime, "VOLUME")[0]) == [env["HF_HOME"]]
    # Exec form, so the server itself is PID 1 and gets SIGTERM.
    assert json.loads(instructions(runtime, "ENTRYPOINT")[0]) == ["loraserve", "serve"]
    (healthcheck,) = instructions(runtime, "HEALTHCHECK")
    assert "/health" in healthcheck and "LORASERVE_PORT" in healthcheck


def test_build_context_keeps_what_the_dockerfile_copies():
    """Every COPY source exists and no .dockerignore pattern drops it."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    builder = dockerfile_stages()[0]
    sources = [src for copy in instructions(builder, "COPY") for src in shlex.split(copy)[:-1]]
    assert {"pyproject.toml", "engine", "platform/loraserve"} <= set(sources)
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such path"
        for pattern in patterns:
            # Docker matches patterns against the path and its parents (`build` drops build/x too).
            parts = source.split("/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            assert not any(fnmatch.fnmatch(p, pattern.removeprefix("**/")) for p in prefixes), (
                f".dockerignore pattern {pattern!r} drops {source}"
            )
    assert any(p.startswith(".venv") for p in patterns) and ".git" in patterns
