"""Speculative decoding with adapters that own an embedding or LM head: their verification steps replay the
verification graphs (spec_decode/verify_graphs.py, uncaptured on the CPU with the interpreted kernels),
the own heads and embedding gather inside, and greedy tokens stay transformers + PEFT's (float32) in a
batch mixing them with a plain adapter and the base model."""

from __future__ import annotations

import pytest
from formats_fixtures import SPEC_NGRAM, VocabReplays, make_vocab_spec_case

from engine import LLM, SamplingParams
from engine.cuda_graphs import UNCAPTURED_GRAPHS_ENV

NUM_TOKENS = 14


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_vocab_spec_case(tmp_path_factory.mktemp("vocab-spec"), NUM_TOKENS)


@pytest.mark.slow
@pytest.mark.interpreted
def test_vocab_verification_steps_replay_the_verify_graphs(case, monkeypatch):
    monkeypatch.setenv(UNCAPTURED_GRAPHS_ENV, "1")
    llm = LLM(
        str(case["model"]),
        lora_modules={k: str(v) for k, v in case["adapters"].items()},
        speculative_config=SPEC_NGRAM,
        skip_tokenizer_init=True,
        max_model_len=40,
        block_size=4,
        max_loras=3,
        max_vocab_loras=2,
        max_lora_rank=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        attention_backend="triton",
        dtype="float32",
    )
    runner = llm.engine.runner
    verify_graphs = runner.verify_graphs
    assert verify_graphs is not None  # built (uncaptured) beside the decode graphs
    replays = VocabReplays(runner)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(case["prompts"], params, case["assigned"])
    spec = llm.engine.stats().spec_decode
    llm.shutdown()
    for output, expected, adapter in zip(outputs, case["expected"], case["assigned"]):
        assert output.error is None, output.error
        assert output.outputs[0].token_ids == expected, f"adapter {adapter}"
    assert spec.num_accepted_tokens > 0
    # the verification steps that held own-embedding / own-head tokens ran in the verification graphs
    # (eager before: 0)
    assert replays.verify_vocab > 0
    assert verify_graphs.num_replays == replays.verify_total
