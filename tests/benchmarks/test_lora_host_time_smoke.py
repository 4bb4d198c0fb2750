"""benchmarks/lora_host_time.py --smoke: the LoRA host-time benchmark runs (meta tensors, no math) and
both variants make the same launches, two per call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_lora_host_time_benchmark_runs():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/lora_host_time.py", "--smoke"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = re.search(r"(\d+) calls.*launches per step (\d+) / (\d+)", result.stdout)
    assert summary, result.stdout
    calls, before, after = map(int, summary.groups())
    assert before == after == 2 * calls
