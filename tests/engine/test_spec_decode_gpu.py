"""Speculative decoding on CUDA (Triton attention, grouped-LoRA kernels, verification steps replaying their
CUDA graphs, decode graphs for steps without proposals): greedy tokens equal those without speculation
(float32, where the kernels' rounding cannot flip an argmax of this model), proposals accepted, most
steps served by a verification graph, and no kernel compiled after ready."""

from __future__ import annotations

import pytest
import torch
from spec_decode_fixtures import echo_prompts, make_echo_case

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_echo_case(tmp_path_factory.mktemp("spec-gpu"))


@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft_model"],
)
def test_greedy_tokens_identical_on_cuda(case, config):
    if config["method"] == "draft_model":
        config = {**config, "model": str(case["other"])}
    config = {**config, "fallback_acceptance_rate": 0.0}
    names = [*case["adapters"], None]
    prompts = echo_prompts(8)
    adapters = [names[i % 3] for i in range(len(prompts))]
    # Different lengths: the batch shrinks through buckets 8, 4, 2, 1 (padding lanes on the way).
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(8)]
    results = []
    for speculative_config in (None, config):
        llm = LLM(
            str(case["model"]),
            lora_modules={k: str(v) for k, v in case["adapters"].items()},
            speculative_config=speculative_config,
            skip_tokenizer_init=True,
            device="cuda",
            dtype="float32",
            max_model_len=96,
            block_size=16,
            max_loras=2,
            max_lora_rank=8,
            max_num_seqs=8,
            num_kv_blocks=64,
        )
        steps = _count_verification_steps(llm.engine.runner)
        outputs = llm.generate(prompts, params, adapters)
        results.append([o.outputs[0].token_ids for o in outputs])
        assert llm.engine.stats().num_kernel_compiles_after_ready == 0
    assert results[0] == results[1]
    spec = llm.engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    verify_graphs = llm.engine.runner.verify_graphs
    assert verify_graphs is not None and verify_graphs.buckets == [1, 2, 4, 8]
    assert len(verify_graphs.graphs) == 8  # every bucket, with and without LoRA
    # Every step that verified proposals with at most k + 1 tokens per request replayed a graph.
    assert steps["verifying"] > 10
    assert steps["replayed"] == steps["verifying"] == verify_graphs.num_replays


def _count_verification_steps(runner) -> dict[str, int]:
    """Wrap runner.execute: steps whose requests each add at most k + 1 = 4 tokens, some verifying
    proposals, and how many of them a verification graph served."""
    steps = {"verifying": 0, "replayed": 0}
    execute = runner.execute

    def counted(scheduled, in_flight=None):
        graphs = runner.verify_graphs
        before = graphs.num_replays if graphs is not None else 0
        logits = execute(scheduled, in_flight)
        if any(s.num_spec_tokens for s in scheduled) and max(s.num_new_tokens for s in scheduled) <= 4:
            steps["verifying"] += 1
            steps["replayed"] += graphs is not None and graphs.num_replays == before + 1
        return logits

    runner.execute = counted
    return steps


def test_verification_graphs_can_be_switched_off(case):
    config = {"method": "ngram", "num_speculative_tokens": 3, "cuda_graphs": False}
    llm = LLM(
        str(case["model"]),
        speculative_config=config,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=96,
        max_num_seqs=4,
        num_kv_blocks=32,
    )
    assert llm.engine.runner.graphs is not None
    assert llm.engine.runner.verify_graphs is None
