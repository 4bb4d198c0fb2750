"""LoRA on the dense layers' MLPs of a mixture of experts (GLM-4.5's first `first_k_dense_replace`
layers, Qwen3-MoE's and Qwen2-MoE's `mlp_only_layers`): their gate_proj, up_proj and down_proj are
targets of intermediate_size beside attention, the routed experts and the shared experts. Greedy tokens
equal transformers + PEFT on tiny random float32 checkpoints with a DoRA adapter on the dense MLPs alone
and one on everything (factories.dense_layer_adapters), mixed with an attention-only adapter and
base-model requests in one batch; over two ranks (gloo) too, tensor- and expert-parallel, the dense
MLP's pairs split as a dense model's."""

from __future__ import annotations

import multiprocessing
import random

import pytest
from factories import MOE_ADAPTERS, dense_layer_adapters, make_adapter, make_model, per_adapter_reference
from test_moe_models import expected_tokens, greedy

from engine import LLM, model_shape
from engine.model.loader import load_config

NUM_NEW_TOKENS = 6


def adapters(arch: str) -> dict[str, dict]:
    return {"attn_r4": MOE_ADAPTERS["attn_r4"], **dense_layer_adapters(arch)}


@pytest.fixture(scope="module", params=["glm4_moe", "qwen3_moe", "qwen2_moe"])
def case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"dense-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=3)
    paths = {
        name: make_adapter(model_dir, root / name, seed=40 + i, **kwargs)
        for i, (name, kwargs) in enumerate(adapters(arch).items())
    }
    rng = random.Random(arch)
    assigned = ["everything_r16", "dense_dora_r8", None, "attn_r4", "everything_r16", "dense_dora_r8"]
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(6, 14))] for _ in assigned]
    references = per_adapter_reference(model_dir, paths)
    expected = [expected_tokens(references[a], p, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    for prompt, adapter, tokens in zip(prompts, assigned, expected):  # each adapter changes the answer
        if adapter is not None:
            assert tokens != expected_tokens(references[None], prompt, NUM_NEW_TOKENS), adapter
    return dict(
        arch=arch, model_dir=model_dir, paths=paths, prompts=prompts, assigned=assigned, expected=expected
    )


def test_dense_mlp_targets_only_where_the_model_has_dense_layers(case):
    shape = model_shape(load_config(case["model_dir"]))
    assert shape.dense_layers == ((0,) if case["arch"] == "glm4_moe" else (1,))  # Qwen's mlp_only_layers
    dense = shape.targets.index("gate_proj")
    assert shape.targets[dense : dense + 3] == ("gate_proj", "up_proj", "down_proj")
    assert shape.module_dims("gate_proj") == (shape.hidden_size, shape.intermediate_size)
    mixtral = model_shape(load_config(make_model(case["model_dir"].parent / "mixtral", arch="mixtral")))
    assert "gate_proj" not in mixtral.targets and mixtral.dense_layers == ()


def generate(case, **kwargs):
    lora_modules = {k: str(v) for k, v in case["paths"].items()}
    llm = LLM(
        model=str(case["model_dir"]), lora_modules=lora_modules, max_loras=3, max_lora_rank=16,
        block_size=4, max_model_len=64, dtype="float32", **kwargs,
    )  # fmt: skip
    try:
        prompts = [{"prompt_token_ids": p} for p in case["prompts"]]
        outputs = llm.generate(prompts, greedy(NUM_NEW_TOKENS), adapters=case["assigned"])
    finally:
        llm.engine.shutdown()
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_peft(case):
    assert generate(case) == case["expected"]


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_peft(case, expert_parallel):
    got = generate(
        case, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, async_scheduling=False
    )
    assert got == case["expected"]
    assert [p for p in multiprocessing.active_children() if p.name.startswith("tp-worker")] == []


@pytest.mark.slow
def test_triton_path_matches_peft(case):
    """The Triton path (interpreted: fused MoE, the dense MLP's grouped LoRA and DoRA) gives PEFT's tokens
    too; GLM-4.5 only, as its dense layer and shared experts cover the others' paths."""
    if case["arch"] != "glm4_moe":
        pytest.skip("GLM-4.5 covers the same kernels")
    got = generate(case, attention_backend="triton", max_num_seqs=8)
    assert got == case["expected"]
