"""CUDA-graph decode: replays give the eager engine's greedy tokens, and transformers + PEFT's, on a batch
mixing adapters and the base model (GPU only)."""

from __future__ import annotations

import random

import pytest
import torch
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy

from engine import LLM, SamplingParams
from engine.cuda_graphs import batch_buckets

NUM_NEW_TOKENS = 12


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    model_dir = make_model(root / "model", arch="llama", seed=2)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=30 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    rng = random.Random(5)
    names = [*adapters, None]
    # 11 prompts: decode batches shrink through several buckets (8, then the 3 admitted later).
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 30))] for _ in range(11)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned)


def generate(
    case,
    dtype: str,
    enforce_eager: bool,
    num_prompts: int | None = None,
    prompt_len: int | None = None,
    kv_cache_dtype: str = "auto",
):
    llm = LLM(
        model=str(case["model_dir"]),
        skip_tokenizer_init=True,
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        max_loras=4,
        max_lora_rank=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=128,
        dtype=dtype,
        device="cuda",
        enforce_eager=enforce_eager,
        num_kv_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    prompts = [p[:prompt_len] for p in case["prompts"][:num_prompts]]
    adapters = case["assigned"][: len(prompts)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
    assert all(o.error is None for o in outputs)
    graphs = llm.engine.runner.graphs
    return [o.outputs[0].token_ids for o in outputs], graphs


# float32: 11 prompts of mixed lengths, so decode batches are padded (to buckets 8 and 4) and mixed
# steps stay eager. bfloat16: 8 prompts of 3 tokens, so every decode step has batch 8 in both runs and the
# same kernels run on the same shapes: bf16 rounding cannot differ between them.
@needs_cuda
@pytest.mark.parametrize("dtype, num_prompts, prompt_len", [("float32", None, None), ("bfloat16", 8, 3)])
def test_graph_replay_matches_eager(case, dtype, num_prompts, prompt_len):
    eager, no_graphs = generate(case, dtype, True, num_prompts, prompt_len)
    replayed, graphs = generate(case, dtype, False, num_prompts, prompt_len)
    assert no_graphs is None
    assert graphs is not None and graphs.num_replays >= NUM_NEW_TOKENS - 1, (
        "decode steps should replay graphs"
    )
    assert replayed == eager


@needs_cuda
@pytest.mark.parametrize("dtype, num_prompts, prompt_len", [("float32", None, None), ("bfloat16", 8, 3)])
def test_fp8_kv_cache_graph_replay_matches_eager(case, dtype, num_prompts, prompt_len):
    """float8 caches with per-layer scales (device tensors the graphs read): replays give eager's tokens."""
    eager, _ = generate(case, dtype, True, num_prompts, prompt_len, kv_cache_dtype="fp8")
    replayed, graphs = generate(case, dtype, False, num_prompts, prompt_len, kv_cache_dtype="fp8")
    assert graphs is not None and graphs.num_replays >= NUM_NEW_TOKENS - 1, (
        "decode steps should replay graphs"
    )
    assert all(k.dtype == torch.float8_e4m3fn for k, _ in graphs.kv_caches)
    assert replayed == eager


@needs_cuda
def test_graph_replay_matches_transformers_peft(case):
    """float32 on the GPU, as C1 on the CPU: the same greedy tokens as the reference."""
    replayed, graphs = generate(case, "float32", enforce_eager=False)
    assert graphs.num_replays > 0
    reference = load_peft_reference(case["model_dir"], case["adapters"])
    pairs = zip(case["prompts"], case["assigned"])
    expected = [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in pairs]
    assert replayed == expected
