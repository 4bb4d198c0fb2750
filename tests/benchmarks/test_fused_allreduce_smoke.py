"""benchmarks/fused_allreduce.py needs GPUs; on the CPU its report is checked, so the table cannot rot."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def test_the_report_compares_each_size_and_marks_sizes_past_the_bound():
    sys.path.insert(0, str(REPO))
    from benchmarks.fused_allreduce import report

    args = SimpleNamespace(dtype="bfloat16", reps=20, iters=20)
    rows = [(8192, 1, 16384, 20e-6, 5e-6), (8192, 512, 8 << 20, 60e-6, None)]
    text = report(args, {2: rows, 4: "Traceback ...\nRuntimeError: no P2P"}, "H100")
    assert "| 2 | 8192 | 1 | 16 | 20.0 | 5.0 | 4.00x |" in text
    assert "| 2 | 8192 | 512 | 8192 | 60.0 | - | - |" in text
    assert "| 4 | - | - | - | failed | | RuntimeError: no P2P |" in text
