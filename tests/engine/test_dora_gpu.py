"""DoRA on a GPU (skipped without CUDA): DoRA adapters of ranks 4 to 16 mixed with a plain LoRA adapter
and base-model requests, through the Triton kernels' DoRA epilogue and the decode CUDA graphs:

- float32: greedy tokens identical to transformers + PEFT (float32 on the CPU);
- bfloat16: against transformers + PEFT in bfloat16 on the same GPU, with the decode graphs and eagerly
  (bf16 is not batch-invariant): where a row's greedy tokens first differ, each side's token is among the
  other's top 5 (factories.check_greedy_close; the first-32-token agreement is printed, not held: on
  these tiny models PEFT in bf16 agrees with itself in float32 at ~0.5, benchmarks/bf16_sensitivity.py).

    TRITON_INTERPRET=0 python -m pytest tests/engine/test_dora_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from factories import TOP_LOGPROBS, check_greedy_close, engine_greedy, make_adapter, make_model
from formats_fixtures import greedy_by_adapter, make_dora_adapter

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NUM_TOKENS = 32
ADAPTERS = {
    "dora_qv_r4": (make_dora_adapter, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "dora_all_r16": (make_dora_adapter, dict(r=16, lora_alpha=16, target_modules="all-linear")),
    "dora_mlp_r8": (make_dora_adapter, dict(r=8, lora_alpha=16, target_modules=["up_proj", "down_proj"])),
    "lora_r8": (make_adapter, dict(r=8, lora_alpha=16, target_modules="all-linear")),
}
ARGS = dict(max_loras=4, max_lora_rank=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"dora-gpu-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=1)
    adapters = {
        name: make(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, (make, kwargs)) in enumerate(ADAPTERS.items())
    }
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(17, 60))] for _ in range(20)]
    names = [*adapters, None]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    return dict(arch=arch, model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned)


def run(case, dtype: str, max_tokens: int, enforce_eager: bool = False):
    llm = LLM(
        model=str(case["model_dir"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        dtype=dtype,
        enforce_eager=enforce_eager,
        **ARGS,
    )
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=TOP_LOGPROBS
        )
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in case["prompts"]], params, adapters=case["assigned"]
        )
        assert all(o.error is None for o in outputs)
        replays = 0 if llm.engine.runner.graphs is None else llm.engine.runner.graphs.num_replays
        return [engine_greedy(o) for o in outputs], replays
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_float32_matches_transformers_peft(case):
    expected = greedy_by_adapter(case["model_dir"], case["adapters"], case["prompts"], case["assigned"], 16)
    rows, replays = run(case, "float32", 16)
    assert [tokens for tokens, _ in rows] == expected
    assert replays > 0


def test_bfloat16_agrees_with_transformers_with_graphs_and_eagerly(case):
    expected = greedy_by_adapter(
        case["model_dir"],
        case["adapters"],
        case["prompts"],
        case["assigned"],
        NUM_TOKENS,
        dtype=torch.bfloat16,
        device="cuda",
        top_k=TOP_LOGPROBS,
    )
    graphs, replays = run(case, "bfloat16", NUM_TOKENS)
    eager, _ = run(case, "bfloat16", NUM_TOKENS, enforce_eager=True)
    assert replays > 0
    # bf16 is not batch-invariant (a graph's padded batch can pick other GEMM kernels): graphs and eager
    # are held to the reference and to each other by the top-k check; float32 holds graphs exactly.
    label = f"{case['arch']} DoRA bf16"
    failures = [
        *check_greedy_close(graphs, expected, f"{label}, graphs vs PEFT", NUM_TOKENS),
        *check_greedy_close(eager, expected, f"{label}, eager vs PEFT", NUM_TOKENS),
        *check_greedy_close(graphs, eager, f"{label}, graphs vs eager", NUM_TOKENS),
    ]
    assert not failures, "; ".join(failures)
