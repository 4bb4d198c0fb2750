"""benchmarks/adapter_scale.py: --quick on the CPU (a real server over an adapter store of hard-linked
names, both workloads in two rounds, the report; the cold-start mode from a local store and S3), so the
W2 script cannot rot between GPU runs; and its Zipf draws, its rates from /metrics, its cold-start means."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_w2_benchmark_runs_quick_on_the_cpu(tmp_path):
    """The mixed-rank variant in two rounds (the report gives the median round): the default one differs
    only in its single rank, and runs on a server of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [
        sys.executable,
        "benchmarks/adapter_scale.py",
        "--quick",
        "--state-dir",
        str(tmp_path),
        "--variants",
        "mixed",
        "--runs",
        "2",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 3 uniform", "| 24 Zipf"))]
    assert len(rows) == 2, result.stdout
    assert all(row.rstrip().endswith("| 0 |") for row in rows)  # no request failed
    assert all(row.count(" / ") >= 4 for row in rows)  # both rounds' tok/s beside the median
    assert "Zipf / uniform (mixed): output tok/s" in result.stdout and "medians of 2 rounds" in result.stdout
    assert "rank 2/4/8," in result.stdout


def test_the_cold_start_mode_runs_quick_on_the_cpu(tmp_path):
    """Cold adapters from a local store and from S3 (moto's server on loopback), each against the same
    adapters warm, with another tenant's requests beside them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    command = [
        sys.executable,
        "benchmarks/adapter_scale.py",
        "--quick",
        "--cold-start",
        "--cold-sources",
        "local,s3",
        "--state-dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| local |", "| s3 |"))]
    assert len(rows) == 4, result.stdout  # a cold and a warm pass per source
    assert all(row.rstrip().endswith("| 0 |") for row in rows)  # no request failed
    cold = {row.split("|")[1].strip(): row for row in rows if "| cold |" in row}
    assert "store" in cold["local"] and "store" in cold["s3"]  # cold starts came from the store
    assert "- local: cold / warm TTFT p50" in result.stdout and "- s3: cold / warm TTFT p50" in result.stdout


def _adapter_scale():
    sys.path.insert(0, str(REPO))
    from benchmarks import adapter_scale

    return adapter_scale


def test_zipf_draws_follow_one_over_k():
    names = [f"n{k}" for k in range(10)]
    draws = _adapter_scale().zipf_names(names, 40_000, 1.0, random.Random(0))
    counts = Counter(draws)
    harmonic = sum(1 / (k + 1) for k in range(10))
    for k, name in enumerate(names):
        assert counts[name] / len(draws) == pytest.approx(1 / (k + 1) / harmonic, rel=0.1)


def test_residency_rates_come_from_the_difference_of_two_scrapes():
    hits, misses, loads = (
        "loraserve_adapter_cache_hits_total",
        "loraserve_adapter_cache_misses_total",
        "loraserve_adapter_load_seconds_count",
    )
    before = {(hits, "gpu"): 10, (misses, "gpu"): 10, (hits, "cpu"): 5, (loads, "source"): 3}
    after = {
        (hits, "gpu"): 40,
        (misses, "gpu"): 20,
        (hits, "cpu"): 5,
        (misses, "cpu"): 10,
        (loads, "source"): 13,
        (loads, "cpu"): 15,
        (hits, "kv"): 5,
        (misses, "kv"): 15,
        (loads, "kv"): 5,
        ("loraserve_adapter_kv_cache_blocks", "kv"): 88,
    }
    row = _adapter_scale().residency(before, after, seconds=5.0)  # re-exported from adapter_scale_setup
    assert row["gpu_hit"] == pytest.approx(0.75)  # 30 hits, 10 misses during the run
    assert row["cpu_hit"] == 0.0 and row["kv_hit"] == pytest.approx(0.25)
    assert row["cpu_loads_s"] == pytest.approx(2.0) and row["gpu_loads_s"] == pytest.approx(4.0)
    assert row["kv_loads_s"] == pytest.approx(1.0) and row["kv_blocks"] == 88
    assert row["disk_hit"] != row["disk_hit"]  # no lookups: NaN, not a made-up rate


def test_cold_start_means_come_from_the_histogram_difference():
    sys.path.insert(0, str(REPO))
    from benchmarks.adapter_scale_cold import cold_start_means

    count, total = "loraserve_adapter_cold_start_seconds_count", "loraserve_adapter_cold_start_seconds_sum"
    before = {(count, "store"): 2, (total, "store"): 1.0}
    after = {(count, "store"): 6, (total, "store"): 3.0, (count, "cpu"): 1, (total, "cpu"): 0.002}
    assert cold_start_means(before, after) == pytest.approx({"store": 0.5, "cpu": 0.002})
