"""Adapters with their own embedding or LM head (modules_to_save) and LoRA on embed_tokens / lm_head, served
in one batch with plain adapters and the base model: greedy tokens identical to transformers + PEFT in
float32, on a Llama and on a Llama with tied embeddings, with fewer vocab slots than such adapters (their
slots and rows refilled)."""

from __future__ import annotations

import random

import pytest
import torch
from factories import make_adapter, make_model
from formats_fixtures import VocabReplays, greedy_by_adapter, make_vocab_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.cuda_graphs import UNCAPTURED_GRAPHS_ENV

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
    return dict(
        tied=tied,
        model_dir=model_dir,
        adapters=adapters,
        prompts=prompts,
        assigned=assigned,
        expected=expected,
    )


def make_llm(case, **overrides):
    return LLM(
        model=str(case["model_dir"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        **{
            **dict(
                max_loras=8,
                max_vocab_loras=8,
                max_lora_rank=8,
                block_size=8,
                max_model_len=64,
                dtype="float32",
                max_num_seqs=16,
                max_num_batched_tokens=1024,
            ),
            **overrides,
        },
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # fewer vocab slots and rows than such adapters, loads in loader processes (CUDA's default: a
        # load that lands in a row without room is loaded again into one with room), chunked prefill
        dict(max_loras=3, max_vocab_loras=2, adapter_loader="process", max_num_batched_tokens=8),
    ],
    ids=["room", "refilled"],
)
def test_vocab_adapters_mixed_with_lora_and_base_match_peft(vocab_case, overrides):
    if overrides and vocab_case["tied"]:
        pytest.skip("CI time: the untied model's run covers refills, loader processes and chunks")
    llm = make_llm(vocab_case, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in vocab_case["prompts"]], params, adapters=vocab_case["assigned"]
    )
    for output, expected, adapter in zip(outputs, vocab_case["expected"], vocab_case["assigned"]):
        assert output.error is None, output.error
        assert output.outputs[0].token_ids == expected, f"adapter {adapter}"
    if overrides:
        assert llm.engine.lora.allocator.num_evictions > 0, "vocab slots were meant to be refilled"
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.interpreted
def test_vocab_steps_replay_the_decode_graphs(vocab_case, monkeypatch):
    """The decode graphs' path (replayed uncaptured on the CPU, on the interpreted kernels) serves the
    decode steps of adapters with their own embedding and head, with PEFT's tokens."""
    if vocab_case["tied"]:
        pytest.skip("CI time: the untied model has both an own embedding and an own head")
    monkeypatch.setenv(UNCAPTURED_GRAPHS_ENV, "1")
    llm = make_llm(vocab_case, attention_backend="triton")
    replays = VocabReplays(llm.engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    count = len(vocab_case["adapters"]) + 1  # each adapter once, and the base model
    prompts, assigned = vocab_case["prompts"][:count], vocab_case["assigned"][:count]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
    llm.shutdown()
    for output, expected, adapter in zip(outputs, vocab_case["expected"], assigned):
        assert output.error is None, output.error
        assert output.outputs[0].token_ids == expected, f"adapter {adapter}"
    # every request runs at once: its NUM_NEW_TOKENS - 1 decode steps hold vocab adapters' tokens
    assert replays.vocab == replays.total == NUM_NEW_TOKENS - 1


def test_prompt_logprobs_read_the_adapters_own_head(vocab_case):
    """Prompt logprobs come from each row's own head (and embedding), as PEFT's logits."""
    name = "mts_embed_tied" if vocab_case["tied"] else "mts_head"
    prompt = vocab_case["prompts"][0]
    llm = make_llm(vocab_case)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    output = llm.generate([{"prompt_token_ids": prompt}], params, adapters=[name])[0]
    llm.shutdown()
    base = AutoModelForCausalLM.from_pretrained(vocab_case["model_dir"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, vocab_case["adapters"][name]).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        expected = logprobs[position - 1, prompt[position]].item()
        assert entry.logprob == pytest.approx(expected, abs=1e-4)


def test_vocab_slots_are_bounded_by_max_loras():
    EngineConfig(model="m", max_vocab_loras=1, tensor_parallel_size=2)  # split by vocabulary over ranks
    with pytest.raises(ValueError, match=r"max_vocab_loras \(5\) must be from 0 to max_loras \(4\)"):
        EngineConfig(model="m", max_vocab_loras=5, max_loras=4)
