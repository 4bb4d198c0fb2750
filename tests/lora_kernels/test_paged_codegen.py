"""The paged kernels compile to the dense kernels' memory traffic (sm90 code, checked without a GPU).

A slot's weights in pages must cost what a dense stack costs: the same 16-byte vector loads and
asynchronous copies of the weights, no more shared memory and no more barriers. B kept transposed in
the pages (the first pool) broke this: its expand spread the ranks over warps, reduced them through
shared memory and loaded h one element at a time (1.2x the dense op's time on an H100). The page-id
loads themselves are a few scalar loads per program, not compared. sm90_codegen.py compiles the
kernels for an H100 in a subprocess (the interpreter, which this test session runs, compiles nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_codegen.py")
UNSUPPORTED_TRITON = 77  # sm90_codegen.UNSUPPORTED_TRITON; that module refuses to load under the interpreter


@pytest.fixture(scope="module")
def codegen() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode == UNSUPPORTED_TRITON:
        pytest.skip("this Triton's launch path differs from the one sm90_codegen.py hooks")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["decode qkv", "decode", "decode qkv mixed"])
def test_paged_kernels_move_the_bytes_as_the_dense_ones_do(codegen, case) -> None:
    dense, paged = codegen[f"{case}, dense"], codegen[f"{case}, paged"]
    assert dense.keys() == paged.keys() and len(dense) == 2  # one shrink and one expand kernel
    for kernel, want in dense.items():
        got = paged[kernel]
        assert got["vector_loads"] == want["vector_loads"], (kernel, got, want)
        assert got["async_copies"] == want["async_copies"], (kernel, got, want)
        assert got["shared"] <= want["shared"], (kernel, got, want)
        assert got["barriers"] <= want["barriers"], (kernel, got, want)
