"""benchmarks/serve.py --smoke --fresh-cache on the CPU: the served benchmark (server, client processes,
offline engine, the compile counter scraped from /metrics) cannot rot between GPU runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_served_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/serve.py", "--smoke", "--fresh-cache"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| N=2 | served over HTTP |" in result.stdout and "| N=2 | offline engine |" in result.stdout
    assert re.search(
        r"served N=2 first run: \d+ tok/s; cache entries \d+; compiles after ready \d+", result.stdout
    )
