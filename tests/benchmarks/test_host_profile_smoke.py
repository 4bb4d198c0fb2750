"""benchmarks/host_profile.py --smoke on the CPU (through throughput.py's make_engine), so the profile script
cannot rot between GPU runs: it broke once when make_engine gained an option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_host_profile_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/host_profile.py", "--smoke"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "steady decode steps" in result.stdout
    assert "| schedule |" in result.stdout and "| sampler.launch |" in result.stdout
