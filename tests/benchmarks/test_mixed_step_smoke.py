"""benchmarks/mixed_step.py --smoke on the CPU, so the mixed-step benchmark cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "compare, labels", [("ops", ("fused", "torch")), ("piecewise", ("piecewise", "eager"))]
)
def test_the_mixed_step_benchmark_runs_on_the_cpu(compare, labels):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/mixed_step.py", "--smoke", "--compare", compare]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for label in labels:  # two builds x two chunk sizes
        rows = [line for line in result.stdout.splitlines() if line.startswith(f"| {label} |")]
        assert len(rows) == 2, result.stdout
    assert f"- chunk 32: {labels[0]} / {labels[1]} mixed step" in result.stdout
