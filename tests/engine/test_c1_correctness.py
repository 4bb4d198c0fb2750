"""Workload C1 (docs/ARCHITECTURE.md): greedy tokens identical to transformers + PEFT, with several adapters and
no adapter mixed in one batch, for Llama, Mistral and Qwen2; also through chunked prefill and
through preemption."""

from __future__ import annotations

import random

import pytest
from factories import C1_ADAPTERS, load_peft_reference, make_adapter, make_model, reference_greedy

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 16
ARCH_OVERRIDES = {
    "llama": {},
    # A short window so that prompts longer than it exercise sliding-window attention.
    "mistral": {"sliding_window": 12},
    # Qwen2 has q/k/v biases; tie the embeddings to cover that path too.
    "qwen2": {"tie_word_embeddings": True},
}


@pytest.fixture(scope="module", params=sorted(ARCH_OVERRIDES))
def c1_case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"c1-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=1, **ARCH_OVERRIDES[arch])
    adapters = {
        name: make_adapter(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(C1_ADAPTERS.items())
    }
    rng = random.Random(arch)
    names = [*adapters, None]
    # 15 prompts of 3..40 tokens, adapters cycled so that every batch mixes them and the base model.
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 41))] for _ in range(15)]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    reference_model = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference_model, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned, expected=expected)


ENGINE_SETTINGS = {
    "plain": dict(max_num_seqs=16, max_num_batched_tokens=1024),
    # Every prompt longer than 8 tokens is split across steps, mixed with other requests' decodes.
    "chunked_prefill": dict(max_num_seqs=16, max_num_batched_tokens=8),
    # 16 blocks of 4 tokens cannot hold 15 sequences of up to 56 tokens: requests get preempted and recomputed.
    "preemption": dict(
        max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=16, block_size=4, max_model_len=64
    ),
    "no_prefix_cache": dict(max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False),
}


@pytest.mark.parametrize("setting", sorted(ENGINE_SETTINGS))
def test_greedy_matches_transformers_peft(c1_case, setting):
    args = dict(max_loras=4, max_lora_rank=16, block_size=8, max_model_len=128, dtype="float32")
    args.update(ENGINE_SETTINGS[setting])
    llm = LLM(
        model=str(c1_case["model_dir"]),
        lora_modules={k: str(v) for k, v in c1_case["adapters"].items()},
        **args,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in c1_case["prompts"]], params, adapters=c1_case["assigned"]
    )
    for output, expected, adapter in zip(outputs, c1_case["expected"], c1_case["assigned"]):
        assert output.error is None
        assert output.outputs[0].token_ids == expected, f"adapter {adapter}"
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV cache was meant to force preemption"


def test_fewer_slots_than_adapters(c1_case):
    """max_loras 2 with 4 adapters in flight: adapters are swapped through the slots between steps."""
    llm = LLM(
        model=str(c1_case["model_dir"]),
        max_loras=2,
        max_lora_rank=16,
        max_num_seqs=8,
        block_size=8,
        max_model_len=128,
        dtype="float32",
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    adapters = [str(c1_case["adapters"][a]) if a else None for a in c1_case["assigned"]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in c1_case["prompts"]], params, adapters=adapters)
    assert [o.outputs[0].token_ids for o in outputs] == c1_case["expected"]
    assert llm.engine.lora.allocator.num_evictions > 0


def test_a_pool_smaller_than_max_loras_at_max_rank(c1_case):
    """lora_pool_rank_budget 24 (3 pages of 8 rank rows) with 4 free slots: ranks 4, 8, 8 fit at once, the
    rank-16 adapter needs two pages, so adapters are evicted for pages, not for slots."""
    llm = LLM(
        model=str(c1_case["model_dir"]),
        max_loras=4,
        max_lora_rank=16,
        lora_pool_rank_budget=24,
        max_num_seqs=8,
        block_size=8,
        max_model_len=128,
        dtype="float32",
    )
    assert llm.engine.runner.lora_slots.num_pages == 3
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    adapters = [str(c1_case["adapters"][a]) if a else None for a in c1_case["assigned"]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in c1_case["prompts"]], params, adapters=adapters)
    assert [o.outputs[0].token_ids for o in outputs] == c1_case["expected"]
    assert llm.engine.lora.allocator.num_evictions > 0
