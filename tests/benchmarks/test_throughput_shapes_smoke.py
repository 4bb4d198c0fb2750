"""benchmarks/throughput.py over several architectures' shapes in one invocation (W1 on Qwen3- and
Gemma-3-shaped models next to Llama's), on the CPU with tiny sizes, so the GPU command cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import w1_setup as w1
from engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]


def test_several_shapes_in_one_invocation_with_dummy_weights():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "benchmarks/throughput.py",
        "--smoke",
        "--smoke-shapes",
        "qwen3-smoke",
        "gemma3-smoke",
        "--skip-transformers",
        "--load-format",
        "dummy",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    headers = [line for line in result.stdout.splitlines() if line.startswith("W1, shape")]
    assert len(headers) == 2
    assert "Qwen3ForCausalLM" in headers[0] and "Gemma3ForCausalLM" in headers[1]
    assert all("load_format dummy" in h for h in headers)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| engine")]
    assert len(rows) == 6 and all(
        float(row.split("|")[9]) > 0 for row in rows
    )  # no LoRA, N=1, N=2; step / floor


def test_a_family_checkpoint_is_written_as_the_engine_reads_it(tmp_path):
    """The random checkpoint of a non-Llama shape: transformers' names, loadable by the engine."""
    model_dir = w1.make_model(tmp_path / "model", "gemma3-smoke", torch.float32, torch.device("cpu"))
    llm = LLM(model=str(model_dir), dtype="float32", block_size=4, max_model_len=32)
    outputs = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0.0, max_tokens=2))
    assert outputs[0].error is None
    config = w1.llama_config("gemma3-smoke")
    assert w1.base_weight_bytes(config, 4) > 512 * 64 * 4  # the tied head is counted once
