"""Tensor parallelism on GPUs (skipped without CUDA): workload C1 with tensor_parallel_size 1 still matches
transformers + PEFT through the Triton kernels and the decode CUDA graphs, with no worker and no
collective; with two GPUs, tensor_parallel_size 2 (NCCL, collectives captured in the graphs) matches too.

    TRITON_INTERPRET=0 python -m pytest tests/engine/test_tensor_parallel_gpu.py -m gpu -q
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
ENGINE_ARGS = dict(
    max_loras=2, max_lora_rank=16, dtype="float32", max_num_seqs=16, max_num_batched_tokens=16, block_size=16
)


@pytest.fixture(scope="module")
def c1_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-gpu")
    model_dir = make_model(root / "model", arch="qwen2", seed=1)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    rng = random.Random(7)
    names = [*adapters, None]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 41))] for _ in range(15)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    reference_model = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference_model, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned, expected=expected)


def run(case, tp: int):
    llm = LLM(
        model=str(case["model_dir"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        tensor_parallel_size=tp,
        **ENGINE_ARGS,
    )
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in case["prompts"]], GREEDY, adapters=case["assigned"]
        )
        runner = llm.engine.runner
        return [o.outputs[0].token_ids for o in outputs], runner
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()  # the next engine profiles the memory this one held


def test_one_gpu_matches_peft_with_no_parallel_machinery(c1_case):
    tokens, runner = run(c1_case, 1)
    assert tokens == c1_case["expected"]
    assert runner.parallel is None
    assert runner.graphs is not None and runner.graphs.num_replays > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_match_one_and_peft(c1_case):
    tokens, runner = run(c1_case, 2)
    assert tokens == c1_case["expected"]
    assert runner.graphs is not None and runner.graphs.num_replays > 0  # NCCL inside the decode graphs
    assert runner.model.num_heads == 2
