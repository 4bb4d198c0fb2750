"""Nothing is compiled once the engine is ready (GPU only): a varied workload after start-up, with batch
sizes, prompt lengths, adapters and sampling settings all over the place, compiles no Triton kernel.

    TRITON_INTERPRET=0 python3 -m pytest tests/engine/test_compiles_after_ready.py -m gpu -q
"""

from __future__ import annotations

import random

import pytest
import torch
from factories import C1_ADAPTERS, make_adapter, make_model

from engine import LLM, SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=3, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.7, min_tokens=3, max_tokens=8, stop_token_ids=[5]),
]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiles")
    model_dir = make_model(root / "model", arch="llama", seed=4)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=40 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    return model_dir, adapters


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "enforce_eager, kv_cache_dtype, max_loras, quantization",
    [(False, "auto", 4, None), (True, "auto", 4, None), (False, "fp8", 2, None), (False, "auto", 4, "fp8")],
    ids=["graphs", "eager", "graphs-fp8-kv", "graphs-fp8-weights"],
)
def test_no_kernel_compiles_after_ready(case, enforce_eager, kv_cache_dtype, max_loras, quantization):
    model_dir, adapters = case
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        lora_modules={k: str(v) for k, v in adapters.items()},
        max_loras=max_loras,
        max_lora_rank=16,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        block_size=16,
        max_model_len=256,
        dtype="bfloat16",
        device="cuda",
        enforce_eager=enforce_eager,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
    )
    engine = llm.engine
    assert engine.stats().num_kernel_compiles_after_ready == 0
    rng = random.Random(3)
    names = [*adapters, None]
    for batch_size in (1, 2, 3, 5, 8, 13, 16, 24, 40):
        prompts = [
            {
                "prompt_token_ids": [
                    rng.randrange(3, 512) for _ in range(rng.choice([1, 2, 15, 16, 17, 63, 200]))
                ]
            }
            for _ in range(batch_size)
        ]
        chosen = [rng.choice(names) for _ in prompts]
        params = [PARAMS[rng.randrange(len(PARAMS))] for _ in prompts]
        outputs = llm.generate(prompts, params, adapters=chosen)
        assert all(o.error is None for o in outputs)
    compiled = engine.stats().num_kernel_compiles_after_ready
    assert compiled == 0, f"{compiled} kernel variants compiled after ready: {list(engine._compiles.recent)}"
