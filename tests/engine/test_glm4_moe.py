"""What GLM-4.5 / GLM-4.6 adds to the mixtures of experts of test_moe_models.py (which holds its greedy
tokens to transformers + PEFT with adapters on attention, the routed and the shared experts): DoRA on the
shared experts equals PEFT's, on one rank and on two; the grouped
sigmoid routing equals transformers' router on fresh random inputs (the bias steers the choice, never the
weights); the multi-token-prediction layer's tensors are skipped at load as vLLM skips them, anything
past them is refused naming it; configs the routing cannot serve are refused naming the setting."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from factories import SHARED_EXPERTS, make_adapter, make_model, per_adapter_reference
from safetensors.torch import load_file, save_file
from test_moe_models import expected_tokens
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from engine import LLM, SamplingParams
from engine.model.layers.grouped_topk_moe import GroupedTopK, grouped_top_k
from engine.model.registry import model_class

ARGS = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64, dtype="float32", max_num_seqs=2)


@pytest.mark.parametrize(
    "experts, groups, top_groups, top_k, renormalize, scaling",
    [(8, 4, 2, 2, True, 2.5), (12, 3, 1, 3, False, 1.0), (16, 1, 1, 4, True, 1.0), (10, 5, 3, 5, True, 1.8)],
)
def test_grouped_routing_matches_transformers(experts, groups, top_groups, top_k, renormalize, scaling):
    torch.manual_seed(experts + groups)
    config = Glm4MoeConfig(
        hidden_size=32, n_routed_experts=experts, n_group=groups, topk_group=top_groups,
        num_experts_per_tok=top_k, norm_topk_prob=renormalize, routed_scaling_factor=scaling,
    )  # fmt: skip
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)  # large enough to change choices
    x = torch.randn(64, 32)
    _, want_weights, want_ids = router(x)
    logits = x @ router.weight.T
    weights, ids = grouped_top_k(
        logits, router.e_score_correction_bias, top_k, GroupedTopK(groups, top_groups, scaling), renormalize
    )
    # Top-k unsorted in both: compare per token by expert.
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))
    size = experts // groups  # every chosen expert lies in one of the topk_group kept groups
    assert all(len(set(row)) <= top_groups for row in (ids // size).tolist())
    routing = GroupedTopK(groups, top_groups, scaling)
    _, unbiased = grouped_top_k(logits, torch.zeros(experts), top_k, routing, renormalize)
    assert not torch.equal(unbiased.sort(dim=-1).values, ids.sort(dim=-1).values)  # the bias steers choices
    chosen = torch.sigmoid(logits).gather(1, ids)  # ... but the weights are the unbiased scores
    if renormalize:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, chosen * scaling)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("glm4-moe") / "model", arch="glm4_moe", seed=6)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dora_on_the_shared_experts_matches_peft(model_dir, tmp_path, tp):
    """The shared experts' DoRA is the dense path's; over two ranks their row-parallel down_proj norms
    are all-reduced."""
    adapter = make_adapter(
        model_dir, tmp_path / "dora", seed=5, r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", *SHARED_EXPERTS]
    )  # fmt: skip
    prompts = [[7, 300, 41, 9, 122, 64, 5, 88, 230, 17, 3, 499], [11, 12, 400, 250, 6, 90, 31, 77]]
    assigned = ["dora", None]
    references = per_adapter_reference(model_dir, {"dora": adapter})
    expected = [expected_tokens(references[a], p, 6) for p, a in zip(prompts, assigned)]
    assert expected[0] != expected_tokens(references[None], prompts[0], 6)
    parallel = dict(tensor_parallel_size=2, async_scheduling=False) if tp > 1 else {}
    llm = LLM(
        model=str(model_dir), lora_modules={"dora": str(adapter)}, **{**ARGS, "max_num_seqs": 4}, **parallel
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.engine.shutdown()


def generate(path):
    llm = LLM(model=str(path), **ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": [5, 9, 33, 71, 4]}], params)]


def with_tensors(model_dir, out, extra):
    shutil.copytree(model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_the_mtp_layer_is_skipped_and_what_lies_past_it_refused(model_dir, tmp_path):
    """num_nextn_predict_layers (1 by default) layers follow the last decoder layer in GLM-4.5's checkpoints
    (model.layers.92 of GLM-4.5's 92): speculative decoding's, skipped; a layer past them is not GLM's."""
    layers = 3
    mtp = {
        f"model.layers.{layers}.eh_proj.weight": torch.randn(64, 128),
        f"model.layers.{layers}.enorm.weight": torch.ones(64),
        f"model.layers.{layers}.mlp.experts.0.gate_proj.weight": torch.randn(32, 64),
        f"model.layers.{layers}.shared_head.head.weight": torch.randn(512, 64),
    }
    expected = generate(model_dir)
    assert generate(with_tensors(model_dir, tmp_path / "mtp", mtp)) == expected
    past = {f"model.layers.{layers + 1}.enorm.weight": torch.ones(64)}
    with pytest.raises(ValueError, match=rf"does not use: \['model.layers.{layers + 1}.enorm.weight'\]"):
        LLM(model=str(with_tensors(model_dir, tmp_path / "past", past)), **ARGS)
    odd = {"model.layers.1.mlp.shared_experts.down_proj.bias": torch.zeros(64)}
    with pytest.raises(
        ValueError, match=r"does not use: \['model.layers.1.mlp.shared_experts.down_proj.bias'\]"
    ):
        LLM(model=str(with_tensors(model_dir, tmp_path / "odd", odd)), **ARGS)


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(n_routed_experts=8, n_group=3), "n_group"),
        (dict(n_routed_experts=8, n_group=8, topk_group=2), "n_group"),  # groups of one expert
        (dict(n_group=4, topk_group=5), "topk_group"),
        (dict(n_group=4, topk_group=1, n_routed_experts=8, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(n_shared_experts=0), "n_shared_experts"),
    ],
)
def test_configs_the_routing_cannot_serve_are_refused(settings, named):
    config = Glm4MoeConfig(architectures=["Glm4MoeForCausalLM"], **settings)
    with pytest.raises(ValueError, match=named):
        model_class(config).check_config(config)


def test_peft_rewritten_mlp_targets_match_peft(model_dir, tmp_path):
    """What a user gets from PEFT 0.21 on transformers 5 with `target_modules` naming the MLP projections
    (`gate_proj`, `up_proj`, `down_proj`, the shared experts' too): PEFT rewrites them into target_parameters
    on the routed experts alone (bare `gate_up_proj` / `down_proj`, gate_up_proj at twice the rank and alpha
    through rank_pattern and alpha_pattern) and saves that; the engine serves it as PEFT runs it."""
    adapter = make_adapter(
        model_dir, tmp_path / "rewritten", seed=9, r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]
    )  # fmt: skip
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["q_proj"] and saved["rank_pattern"]  # PEFT's rewritten form
    prompts = [[7, 300, 41, 9, 122, 64, 5, 88], [11, 12, 400, 250, 6, 90]]
    assigned = ["rewritten", None]
    references = per_adapter_reference(model_dir, {"rewritten": adapter})
    expected = [expected_tokens(references[a], p, 6) for p, a in zip(prompts, assigned)]
    assert expected[0] != expected_tokens(references[None], prompts[0], 6)
    llm = LLM(model=str(model_dir), lora_modules={"rewritten": str(adapter)}, **{**ARGS, "max_num_seqs": 4})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    finally:
        llm.engine.shutdown()
