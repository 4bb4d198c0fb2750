"""benchmarks/mixed_step.py --smoke on the CPU, so the mixed-step benchmark cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_mixed_step_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/mixed_step.py", "--smoke"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| torch |")]
    assert len(rows) == 4, result.stdout  # two builds x two chunk sizes
    assert "- chunk 32: fused / torch mixed step" in result.stdout
