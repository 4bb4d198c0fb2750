"""Speculative decoding on CUDA (Triton attention, grouped-LoRA kernels, decode graphs for steps without
proposals): greedy tokens equal those without speculation (float32, where the kernels' rounding cannot
flip an argmax of this model), proposals accepted, and no kernel compiled after ready."""

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
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
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
        outputs = llm.generate(prompts, params, adapters)
        results.append([o.outputs[0].token_ids for o in outputs])
        assert llm.engine.stats().num_kernel_compiles_after_ready == 0
    assert results[0] == results[1]
    spec = llm.engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
