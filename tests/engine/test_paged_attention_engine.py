"""The engine with the Triton attention backend (interpreted, with its fused norms, RoPE and SiLU) gives
the torch backend's greedy tokens, through prefill, chunked prefill mixed with decodes, and a sliding window."""

from __future__ import annotations

import random

import pytest
from factories import make_model

from engine import LLM, SamplingParams
from engine.config import EngineConfig

NUM_NEW_TOKENS = 4


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    # A window shorter than the longer prompts, so the sliding-window mask matters.
    return make_model(
        tmp_path_factory.mktemp("attn-engine") / "model", arch="mistral", seed=4, sliding_window=10
    )


def greedy(model_dir, backend: str, prompts) -> list[list[int]]:
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        attention_backend=backend,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=64,
    )
    assert llm.engine.runner.model.attention_backend == backend
    assert llm.engine.runner.model.fused == (backend == "triton")  # the Triton path's fused element-wise ops
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_triton_backend_matches_torch_backend(mistral_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 12)]
    expected = greedy(mistral_dir, "torch", prompts)
    assert greedy(mistral_dir, "triton", prompts) == expected


def test_attention_backend_is_validated():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model="m", attention_backend="flash")
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig(model="m", enforce_eager="yes")


def test_auto_backend_is_torch_on_the_cpu():
    config = EngineConfig(model="m", device="cpu")
    assert config.resolved_attention_backend == "torch"
    assert not config.use_cuda_graphs
