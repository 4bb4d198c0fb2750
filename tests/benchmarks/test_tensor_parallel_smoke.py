"""benchmarks/tensor_parallel.py --smoke on the CPU (gloo): each tensor-parallel size in a process of its own,
dummy weights, the table printed last; it cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_tensor_parallel_benchmark_runs_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [sys.executable, "benchmarks/tensor_parallel.py", "--smoke", "--no-profile"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for tp in (1, 2):
        for condition in ("no LoRA", "N=2"):
            assert f"| {tp} | {condition} | warm |" in result.stdout, result.stdout[-3000:]
    assert "failed" not in result.stdout and "- no LoRA, tp=2 / tp=1: decode step" in result.stdout


def test_concurrent_sizes_take_disjoint_gpus():
    sys.path.insert(0, str(REPO))
    from benchmarks.tensor_parallel import placements

    assert placements([1, 2, 4], 4, concurrent=True) == [[(1, 0), (2, 1)], [(4, 0)]]
    assert placements([1, 2, 4], 4, concurrent=False) == [[(1, 0)], [(2, 0)], [(4, 0)]]
    assert placements([2, 2, 1], 4, concurrent=True) == [[(2, 0), (2, 2)], [(1, 0)]]
