"""benchmarks/adapter_formats.py on the CPU with a tiny model, so the GPU command cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_dora_against_plain_lora_runs_and_reports_the_ratio():
    run_smoke([])


@pytest.mark.slow
def test_over_two_ranks_runs_and_reports_the_ratio():
    """The lm_head adapters' vocabulary rows split over the ranks (gloo on the CPU)."""
    run_smoke(["--tensor-parallel-size", "2"])


def run_smoke(extra: list[str]) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "benchmarks/adapter_formats.py",
        "--smoke",
        "--dora-fraction",
        "0.25",
        "--lm-head-fraction",
        "0.25",
        *extra,
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("1 DoRA 1 lm_head") for line in lines), result.stdout
    assert lines[-1].startswith("summary: DoRA + lm_head mix decode step / plain LoRA = ")
