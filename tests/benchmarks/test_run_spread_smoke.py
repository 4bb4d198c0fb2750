"""benchmarks/run_spread.py --smoke on the CPU, so the spread benchmark cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_spread_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [
        sys.executable, "benchmarks/run_spread.py", "--smoke", "--adapters", "2",
        "--phases", "default,steady,pinned,default", "--engine-core-cpus", "1" if (os.cpu_count() or 1) > 1 else "off",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ")]
    runs = [row for row in rows if row not in ("run", "phase")]
    assert runs[:6] == ["warm-up", "default 0.0", runs[2], "steady 1.0", "pinned 2.0", "default 3.0"], runs
    assert runs[2].startswith("(steady: ")  # the plan the steady phase applied
    summary = {row: True for row in runs if row in ("default", "steady", "pinned")}
    assert set(summary) == {"default", "steady", "pinned"}  # one summary row per phase
