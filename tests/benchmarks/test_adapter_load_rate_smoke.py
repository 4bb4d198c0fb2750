"""benchmarks/adapter_load_rate.py --smoke on the CPU (a local store of hard-linked names, loads through a
full disk cache that evicts, in loader processes, the stage breakdown), so the load-rate script cannot rot
between runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_load_rate_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    # A budget of a few smoke-sized entries, filled first: the store pass evicts at every insertion.
    command = [sys.executable, "benchmarks/adapter_load_rate.py", "--smoke", "--cached", "6"]
    command += ["--disk-cache-gib", "0.0002"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "-> CPU tier |" in line]
    assert [row.split("|")[2].strip() for row in rows] == ["store -> CPU tier", "disk -> CPU tier"]
    assert all(float(row.split("|")[3]) > 0 for row in rows)
    assert "| disk cache checkout (+ download) |" in result.stdout
    assert "holding 6 other names" in result.stdout
