"""Adapters with their own embedding or LM head on a GPU (skipped without CUDA), with decode CUDA graphs on:
their decode steps replay the graphs too (engine/lora/vocab.py: static shapes, captured).

- float32: a batch mixing modules_to_save (embed_tokens, lm_head), LoRA on embed_tokens / lm_head, a plain
  adapter and the base model gives transformers + PEFT's greedy tokens (float32 on the CPU), its decode
  steps, which hold own-embedding and own-head tokens, served by graph replays, with no Triton compile
  after ready; then a batch of plain and base requests on the same engine replays graphs and matches too.
- bfloat16: against transformers + PEFT in bfloat16 on the same GPU, with graphs and eagerly (bf16 is not
  batch-invariant, so only float32 holds graphs to eager exactly): where a row's greedy tokens first
  differ, each side's token is among the other's top 5 (factories.check_greedy_close; the first-32-token
  agreement is printed, not held: on this tiny model PEFT in bf16 agrees with itself in float32 at ~0.4,
  benchmarks/bf16_sensitivity.py).
- speculative decoding (n-gram, float32): verification steps holding such adapters' tokens replay the
  verification graphs, with PEFT's greedy tokens.
- tensor parallelism over 2 GPUs (skipped with fewer; float32): each rank holds its vocabulary rows of
  the adapters' matrices, the decode (and, with speculation, verification) graphs replayed on both
  ranks with NCCL inside, PEFT's greedy tokens.

    NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 python -m pytest tests/engine/test_vocab_adapters_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from factories import TOP_LOGPROBS, check_greedy_close, engine_greedy, make_adapter, make_model
from formats_fixtures import (
    SPEC_NGRAM,
    VocabReplays,
    greedy_by_adapter,
    make_vocab_adapter,
    make_vocab_spec_case,
)

from engine import LLM, SamplingParams, kernel_compiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NUM_TOKENS = 32
ADAPTERS = {
    "mts_head": (make_vocab_adapter, dict(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"])),
    "mts_embed": (make_vocab_adapter, dict(r=8, target_modules=["v_proj"], modules_to_save=["embed_tokens"])),
    "lora_embed_head": (
        make_vocab_adapter,
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens", "lm_head"]),
    ),
    "lora_head_nobase": (
        make_vocab_adapter,
        dict(r=4, target_modules=["lm_head"], save_base_layers=False),
    ),
    "plain": (make_adapter, dict(r=16, lora_alpha=16, target_modules="all-linear")),
}
ARGS = dict(
    max_loras=6,
    max_vocab_loras=4,
    max_lora_rank=16,
    max_num_seqs=16,
    max_num_batched_tokens=256,
    max_model_len=128,
)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-gpu")
    model_dir = make_model(root / "model", arch="llama", seed=2)
    adapters = {
        name: make(model_dir, root / name, seed=30 + i, **kwargs)
        for i, (name, (make, kwargs)) in enumerate(ADAPTERS.items())
    }
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(9, 40))] for _ in range(18)]
    names = [*adapters, None]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    return dict(model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned)


def generate(llm, prompts, assigned, max_tokens, logprobs: int | None = None):
    """Greedy token ids of each prompt; with `logprobs`, `Greedy` rows (tokens and top logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=logprobs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids if logprobs is None else engine_greedy(o) for o in outputs]


def make_llm(case, dtype, enforce_eager=False):
    return LLM(
        model=str(case["model_dir"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        dtype=dtype,
        enforce_eager=enforce_eager,
        **ARGS,
    )


def close(llm):
    llm.engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def test_float32_matches_peft_with_vocab_steps_in_graphs(case):
    expected = greedy_by_adapter(case["model_dir"], case["adapters"], case["prompts"], case["assigned"], 16)
    llm = make_llm(case, "float32")
    try:
        replays = VocabReplays(llm.engine.runner)
        assert generate(llm, case["prompts"], case["assigned"], 16) == expected
        # 16 decode tokens a request, and while the first 16 requests run every decode step holds vocab
        # adapters' tokens: most of those steps are replays (if such steps ran eagerly: 0)
        print(f"vocab adapters: {replays.vocab} of {replays.total} decode replays held their tokens")
        assert replays.vocab >= 8
        # the warm-up and the capture compiled the vocab path's kernel (and everything else) before ready
        compiled = llm.engine.stats().num_kernel_compiles_after_ready
        assert compiled == 0, f"{compiled} compiles after ready: {list(kernel_compiles.install().recent)}"
        graphs = llm.engine.runner.graphs
        before = graphs.num_replays
        plain = [i for i, a in enumerate(case["assigned"]) if a in (None, "plain")]
        prompts, assigned = [case["prompts"][i] for i in plain], [case["assigned"][i] for i in plain]
        # the vocab adapters stay resident in their slots; steps that do not use them replay graphs
        assert generate(llm, prompts, assigned, 16) == [expected[i] for i in plain]
        assert graphs.num_replays > before
    finally:
        close(llm)


def test_bfloat16_agrees_with_peft_with_graphs_and_eagerly(case):
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
    rows = {}
    for eager in (False, True):
        llm = make_llm(case, "bfloat16", enforce_eager=eager)
        try:
            rows[eager] = generate(llm, case["prompts"], case["assigned"], NUM_TOKENS, TOP_LOGPROBS)
        finally:
            close(llm)
    # bf16 is not batch-invariant (a graph's padded batch can pick other GEMM kernels): graphs and eager
    # are held to the reference and to each other by the top-k check; float32 holds them exactly.
    failures = [
        *check_greedy_close(rows[False], expected, "vocab adapters bf16, graphs vs PEFT", NUM_TOKENS),
        *check_greedy_close(rows[True], expected, "vocab adapters bf16, eager vs PEFT", NUM_TOKENS),
        *check_greedy_close(rows[False], rows[True], "vocab adapters bf16, graphs vs eager", NUM_TOKENS),
    ]
    assert not failures, "; ".join(failures)


def test_float32_speculative_verification_of_vocab_adapters_replays_graphs(tmp_path):
    case = make_vocab_spec_case(tmp_path, 24)
    llm = LLM(
        str(case["model"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        speculative_config=SPEC_NGRAM,
        skip_tokenizer_init=True,
        max_loras=3,
        max_vocab_loras=2,
        max_lora_rank=8,
        max_num_seqs=4,
        max_model_len=64,
        dtype="float32",
    )
    try:
        replays = VocabReplays(llm.engine.runner)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outputs = llm.generate(case["prompts"], params, case["assigned"])
        assert [o.outputs[0].token_ids for o in outputs] == case["expected"]
        spec = llm.engine.stats().spec_decode
        print(
            f"vocab adapters, speculation: {replays.verify_vocab} of {replays.verify_total} verification "
            f"graph steps held their tokens; {spec.num_accepted_tokens} of {spec.num_draft_tokens} accepted"
        )
        assert replays.verify_vocab > 0 and spec.num_accepted_tokens > 0
    finally:
        close(llm)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_float32_over_two_gpus_matches_peft_with_graphs(case, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the workers inherit it (NVLink multicast off)
    expected = greedy_by_adapter(case["model_dir"], case["adapters"], case["prompts"], case["assigned"], 16)
    llm = LLM(
        model=str(case["model_dir"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        dtype="float32",
        tensor_parallel_size=2,
        **ARGS,
    )
    try:
        replays = VocabReplays(llm.engine.runner)
        assert generate(llm, case["prompts"], case["assigned"], 16) == expected
        print(f"vocab adapters, tp 2: {replays.vocab} of {replays.total} decode replays held their tokens")
        assert replays.vocab >= 8
    finally:
        close(llm)
    spec_case = make_vocab_spec_case(tmp_path, 24)
    llm = LLM(
        str(spec_case["model"]),
        lora_modules={k: str(v) for k, v in spec_case["adapters"].items()},
        speculative_config=SPEC_NGRAM,
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        max_loras=3,
        max_vocab_loras=2,
        max_lora_rank=8,
        max_num_seqs=4,
        max_model_len=64,
        dtype="float32",
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outputs = llm.generate(spec_case["prompts"], params, spec_case["assigned"])
        assert [o.outputs[0].token_ids for o in outputs] == spec_case["expected"]
        stats = llm.engine.stats()
        print(f"vocab adapters, tp 2 with speculation: {stats.num_verify_graph_replays} verification replays")
        assert stats.num_verify_graph_replays > 0
    finally:
        close(llm)
