"""benchmarks/run_spread.py --smoke on the CPU, so the spread benchmark cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_spread_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/run_spread.py", "--smoke", "--adapters", "2"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "warm-up",
        "default 0",
        "1 torch thread 0",
        "1 torch thread, gc.freeze 0",
        "pinned to core 1 0" if (os.cpu_count() or 1) < 3 else "pinned to core 2 0",
        "released 0",
    ]
