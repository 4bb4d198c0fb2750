"""Every LORASERVE_* variable the deploy files set names a `loraserve serve` flag: a misspelt variable
would be ignored silently and the server would run on a default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_files import compose_dict, dockerfile_runtime_env, find, render


def serve_flags() -> set[str]:
    pytest.importorskip("loraserve.cli", reason="needs `loraserve serve` (platform/loraserve/cli.py)")
    loraserve = Path(sys.executable).parent / "loraserve"
    result = subprocess.run(
        [str(loraserve), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(loraserve.parent), "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"--([a-z][a-z0-9-]+)", result.stdout)) - {"help"}


def deploy_variables() -> dict[str, str]:
    """LORASERVE_* name -> where it is set."""
    found = {name: "Dockerfile" for name in dockerfile_runtime_env()}
    for name in compose_dict()["services"]["loraserve"]["environment"]:
        found.setdefault(name, "compose.yaml")
    for overlay in ("base", "gpu"):
        for config in find(render(overlay), "ConfigMap") + find(render(overlay), "Secret"):
            for name in config.get("data", {}) | config.get("stringData", {}):
                found.setdefault(name, f"k8s/{overlay} {config['metadata']['name']}")
    return {name: where for name, where in found.items() if name.startswith("LORASERVE_")}


@pytest.mark.slow
def test_every_variable_is_a_serve_flag():
    flags = serve_flags()
    variables = deploy_variables()
    assert len(variables) >= 10
    unknown = {
        name: where
        for name, where in variables.items()
        if name.removeprefix("LORASERVE_").lower().replace("_", "-") not in flags
    }
    assert not unknown, f"no such `loraserve serve` flag for {unknown}"
