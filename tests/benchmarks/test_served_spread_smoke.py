"""benchmarks/served_spread.py --smoke on the CPU: the run-to-run served benchmark (a server with two
front-end processes, first, measured and sustained runs, client processes reporting their CPU share, the
offline engine, the summary) cannot rot between GPU runs. One front end is benchmarks/serve.py's smoke."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_served_spread_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/served_spread.py", "--smoke", "--servers", "2", "--sustained"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("Summary:") :]
    for server in ("2 front end(s), cpus auto",):
        for workload in ("no LoRA", "N=2"):
            row = re.search(
                rf"\| {re.escape(server)} \| {workload} \| (\d+) \| (\d+) - (\d+) \| ([\d.]+) \|", summary
            )
            assert row, (server, workload, summary)
            median, low, high, slowest = int(row[1]), int(row[2]), int(row[3]), float(row[4])
            assert low <= median <= high and 0 < slowest <= 1.0
    assert re.search(r"\| offline engine \| N=2 \| \d+ \|", summary)
    assert re.search(r"busiest client \d+% CPU", result.stdout)
