"""benchmarks/tensor_parallel.py --smoke on the CPU (gloo): each tensor-parallel size in a process of its own,
dummy weights, the table printed last; it cannot rot between GPU runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


def test_fused_allreduce_runs_each_size_above_one_with_and_without_it():
    sys.path.insert(0, str(REPO))
    from benchmarks.tensor_parallel import placements, report, variants

    assert variants([1, 2, 4], "off") == [(1, False), (2, False), (4, False)]
    assert variants([1, 2], "on") == [(1, False), (2, True)]
    runs = variants([1, 2], "both")
    assert runs == [(1, False), (2, False), (2, True)]
    assert placements([1, 2, 2], 4, True, keys=runs) == [[((1, False), 0), ((2, False), 1)], [((2, True), 0)]]
    row = dict(
        condition="no LoRA",
        run="warm",
        tok_s=100.0,
        ttft=[0.1, 0.2],
        tpot=[0.01, 0.02],
        graph_replays=5,
        step=0.02,
        batch=4,
        floor=0.01,
        startup=1.0,
        shutdown=1.0,
        compiles=0,
        bandwidth=1e9,
        device="GPU",
    )
    results = {
        key: {"rows": [dict(row, step=0.02 / (1 + i), tok_s=100.0 * (1 + i))]} for i, key in enumerate(runs)
    }
    results[(2, True)]["rows"][0]["collectives"] = {"fused all-reduce + norm": 0.001}
    text = report(
        SimpleNamespace(
            shape="L",
            dtype="bfloat16",
            num_requests=4,
            min_prompt=1,
            max_prompt=2,
            output_tokens=3,
            adapters=0,
            rank=16,
            concurrent=False,
        ),
        results,
    )
    assert "| 2 fused | no LoRA | warm |" in text and "0.000 / 0.000 / 0.000 / 1.000" in text
    assert "- no LoRA, tp=2 fused / tp=2: decode step 0.67x, output tok/s 1.50x" in text
