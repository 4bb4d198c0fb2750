"""Piecewise CUDA graphs captured on the GPU (engine/piecewise_graphs.py): steps with prefill tokens replay
them, counted, with the eager engine's greedy tokens and transformers + PEFT's in float32, through chunked
prefill, a cached prefix, mixed adapters of several ranks and base-model rows (GPU only)."""

from __future__ import annotations

import random

import pytest
import torch
from factories import (
    C1_ADAPTERS,
    MOE_ADAPTERS,
    load_peft_reference,
    make_adapter,
    make_model,
    reference_greedy,
)

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("pieces-gpu")
    model_dir = make_model(root / "model", arch="llama", seed=4)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=50 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    rng = random.Random(9)
    names = [*adapters, None]
    shared = [rng.randrange(3, 512) for _ in range(33)]  # a cached prefix of two blocks and more
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 200))] for _ in range(12)]
    for i in (0, 5, 10):  # the same adapter (the cache is per adapter); 10 is admitted after 0 ran
        prompts[i] = shared + prompts[i][:20]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned)


def generate(case, piecewise: bool, enforce_eager: bool = False, **overrides):
    llm = LLM(
        model=str(case["model_dir"]),
        skip_tokenizer_init=True,
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        **{
            **dict(
                max_loras=4,
                max_lora_rank=16,
                max_num_seqs=8,
                # steps of up to 256 tokens: chunked prefill beside decodes, and buckets over 128 tokens
                # (the LoRA kernels' segmented path) as well as under
                max_num_batched_tokens=256,
                block_size=16,
                max_model_len=256,
                dtype="float32",
                device="cuda",
                num_kv_blocks=256,
                enforce_eager=enforce_eager,
                piecewise_cuda_graphs=piecewise,
            ),
            **overrides,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in case["prompts"]], params, adapters=case["assigned"]
    )
    assert all(o.error is None for o in outputs)
    replays = llm.engine.runner.num_graph_replays
    hits = llm.engine.kv_cache.num_hit_tokens
    case["routing"] = llm.engine.stats().moe_expert_tokens
    pieces = llm.engine.runner.pieces
    buckets = None if pieces is None else list(pieces.buckets)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs], replays, hits, buckets


def test_pieces_replay_with_eager_and_peft_tokens(case):
    got, replays, hits, buckets = generate(case, piecewise=True)
    assert buckets == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert replays[2] > 0, f"steps with prefill tokens should replay the pieces: {replays}"
    assert hits > 0, "the shared prefix should hit the cache"
    eager, eager_replays, _, _ = generate(case, piecewise=False)
    assert eager_replays[2] == 0
    assert got == eager
    reference = load_peft_reference(case["model_dir"], case["adapters"])
    pairs = zip(case["prompts"], case["assigned"])
    assert got == [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in pairs]


def test_pieces_with_several_rank_buckets(case):
    """A pool for rank 64 has rank buckets 16 and 64 (C1's ranks 4-16 all in the first): the pieces'
    LoRA variant sizes kernels to both and gives the eager engine's tokens."""
    overrides = dict(max_lora_rank=64)
    got, replays, _, _ = generate(case, piecewise=True, **overrides)
    assert replays[2] > 0
    eager, _, _, _ = generate(case, piecewise=False, enforce_eager=True, **overrides)
    assert got == eager


def test_moe_pieces_keep_tokens_and_routing_counts(tmp_path_factory):
    """Qwen3-MoE with adapters on attention and experts: the fused-MoE kernels inside the pieces give the
    eager engine's tokens, and the routing counts leave the padding rows out."""
    root = tmp_path_factory.mktemp("pieces-moe-gpu")
    model_dir = make_model(root / "model", arch="qwen3_moe", seed=1)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=20 + i, **kwargs)
        for i, (name, kwargs) in enumerate(MOE_ADAPTERS.items())
    }
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 200))] for _ in range(8)]
    names = [*adapters, None]
    case = dict(
        model_dir=model_dir,
        adapters=adapters,
        prompts=prompts,
        assigned=[names[i % len(names)] for i in range(len(prompts))],
    )
    got, replays, _, _ = generate(case, piecewise=True)
    routing = case["routing"]
    assert replays[2] > 0
    eager, _, _, _ = generate(case, piecewise=False)
    assert got == eager
    assert routing == case["routing"] and sum(routing) > 0
