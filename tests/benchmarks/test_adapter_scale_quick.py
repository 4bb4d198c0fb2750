"""benchmarks/adapter_scale.py --quick on the CPU: the W2 script starts a real server over its adapter
store of hard-linked names, drives both workloads and reports, so it cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_w2_benchmark_runs_quick_on_the_cpu(tmp_path):
    """The mixed-rank variant: the default one differs only in its single rank."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [
        sys.executable,
        "benchmarks/adapter_scale.py",
        "--quick",
        "--state-dir",
        str(tmp_path),
        "--mixed-ranks",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 3 uniform", "| 24 Zipf"))]
    assert len(rows) == 2, result.stdout
    assert all(row.rstrip().endswith("| 0 |") for row in rows)  # no request failed
    assert "Zipf / uniform: output tok/s" in result.stdout
    assert "rank 2/4/8," in result.stdout
