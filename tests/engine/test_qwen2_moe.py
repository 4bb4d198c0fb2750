"""What Qwen2-MoE adds to the mixtures of experts of test_moe_models.py (which holds its greedy tokens to
transformers + PEFT): DoRA on the shared expert's projections (the dense path's DoRA) equals PEFT's, on
one rank and on two; what the checkpoint holds and the engine does not implement is refused at load,
naming it; a config without a shared expert is refused naming the setting."""

from __future__ import annotations

import random

import pytest
import torch
from factories import SHARED_EXPERT, make_adapter, make_model, per_adapter_reference
from safetensors.torch import load_file, save_file
from test_moe_models import expected_tokens
from transformers import Qwen2MoeConfig

from engine import LLM, SamplingParams
from engine.model.registry import model_class

ARGS = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64, dtype="float32", max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen2-moe") / "model", arch="qwen2_moe", seed=4)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dora_on_the_shared_expert_matches_peft(model_dir, tmp_path, tp):
    """Over two ranks the shared expert's row-parallel down_proj norms are all-reduced (DoraBase)."""
    adapter = make_adapter(
        model_dir, tmp_path / "dora", seed=5, r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", *SHARED_EXPERT]
    )  # fmt: skip
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(14)] for _ in range(2)]
    assigned = ["dora", None]
    references = per_adapter_reference(model_dir, {"dora": adapter})
    expected = [expected_tokens(references[a], p, 6) for p, a in zip(prompts, assigned)]
    assert expected[0] != expected_tokens(references[None], prompts[0], 6)
    parallel = dict(tensor_parallel_size=2, async_scheduling=False) if tp > 1 else {}
    llm = LLM(model=str(model_dir), lora_modules={"dora": str(adapter)}, **ARGS, **parallel)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.engine.shutdown()


def test_tensors_the_engine_does_not_implement_are_refused_naming_them(model_dir, tmp_path):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(model_dir, odd)
    tensors = load_file(str(odd / "model.safetensors"))
    tensors["model.layers.0.mlp.shared_expert.down_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(odd / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"does not use: \['model.layers.0.mlp.shared_expert.down_proj.bias'\]"
    ):
        LLM(model=str(odd), **ARGS)


def test_a_config_without_a_shared_expert_is_refused():
    config = Qwen2MoeConfig(shared_expert_intermediate_size=0, architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        model_class(config).check_config(config)
