"""benchmarks/moe.py --smoke on the CPU, so the MoE benchmark cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", [[], ["--shape", "gpt-oss-20b"]], ids=["qwen3-moe", "gpt-oss"])
def test_the_moe_benchmark_runs_on_the_cpu(shape):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/moe.py", "--smoke", *shape]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [
        line
        for line in result.stdout.splitlines()
        if line.startswith("| 0 (0) |") or line.startswith("| 2 (")
    ]
    assert len(rows) == 2, result.stdout  # without LoRA, and with 2 adapters on attention + experts
    assert "Summary: N=0:" in result.stdout
