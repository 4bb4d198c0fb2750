"""Adapters with their own embedding or LM head (modules_to_save) and LoRA on embed_tokens / lm_head, served
in one batch with plain adapters and the base model: greedy tokens identical to transformers + PEFT in
float32, on a Llama and on a Llama with tied embeddings, with fewer vocab slots than such adapters (their
slots and rows refilled)."""

from __future__ import annotations

import random

import pytest
from factories import make_adapter, make_model
from formats_fixtures import greedy_by_adapter, make_vocab_adapter

from engine import LLM, SamplingParams

NUM_NEW_TOKENS = 6


def adapters_for(tied: bool) -> dict:
    vocab = make_vocab_adapter
    cases = {
        "mts_embed": (vocab, dict(r=4, target_modules=["v_proj"], modules_to_save=["embed_tokens"])),
        "lora_embed": (vocab, dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens"])),
        "lora_embed_nobase": (
            vocab,
            dict(r=4, target_modules=["embed_tokens"], save_base_layers=False, use_rslora=True),
        ),
        "plain": (make_adapter, dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj"])),
    }
    if tied:
        cases["mts_embed_tied"] = (
            vocab,
            dict(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True),
        )
    else:
        cases["mts_head"] = (vocab, dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
        cases["lora_head"] = (vocab, dict(r=4, lora_alpha=8, target_modules=["o_proj", "lm_head"]))
    return cases


@pytest.fixture(scope="module", params=["llama", "llama_tied"])
def vocab_case(request, tmp_path_factory):
    tied = request.param == "llama_tied"
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root / "model", arch="llama", seed=5, tie_word_embeddings=tied)
    adapters = {
        name: make(model_dir, root / name, seed=40 + i, **kwargs)
        for i, (name, (make, kwargs)) in enumerate(adapters_for(tied).items())
    }
    rng = random.Random(request.param)
    names = [*adapters, None]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 12))] for _ in range(2 * len(names))]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    expected = greedy_by_adapter(model_dir, adapters, prompts, assigned, NUM_NEW_TOKENS)
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned, expected=expected)


@pytest.mark.parametrize("max_loras, max_vocab_loras", [(8, 8), (3, 2)], ids=["room", "refilled"])
def test_vocab_adapters_mixed_with_lora_and_base_match_peft(vocab_case, max_loras, max_vocab_loras):
    llm = LLM(
        model=str(vocab_case["model_dir"]),
        lora_modules={k: str(v) for k, v in vocab_case["adapters"].items()},
        max_loras=max_loras,
        max_vocab_loras=max_vocab_loras,
        max_lora_rank=8,
        block_size=8,
        max_model_len=64,
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=1024,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in vocab_case["prompts"]], params, adapters=vocab_case["assigned"]
    )
    for output, expected, adapter in zip(outputs, vocab_case["expected"], vocab_case["assigned"]):
        assert output.error is None, output.error
        assert output.outputs[0].token_ids == expected, f"adapter {adapter}"
