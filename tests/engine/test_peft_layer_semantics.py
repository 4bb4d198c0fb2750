"""The adapter_config.json keys the engine now reads as PEFT does (layers_to_transform, layers_pattern,
exclude_modules, rank_pattern with alpha_pattern): adapters saved by PEFT with them give the greedy tokens
of transformers + PEFT, in one batch with the base model."""

from __future__ import annotations

import pytest
from factories import load_peft_reference, make_adapter, make_model, reference_greedy

from engine import LLM, SamplingParams

ADAPTERS = {
    "second_layer": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]),
    "first_layer_pattern": dict(
        r=4,
        lora_alpha=8,
        target_modules=["o_proj", "down_proj"],
        layers_to_transform=0,
        layers_pattern="layers",
    ),
    "excluded": dict(r=4, lora_alpha=4, target_modules="all-linear", exclude_modules=["k_proj", "up_proj"]),
    "patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "gate_proj"],
        rank_pattern={"k_proj": 4, r"layers\.1\.mlp\.gate_proj": 2},
        alpha_pattern={"gate_proj": 3},
    ),
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-layers")
    model_dir = make_model(root / "model", seed=3)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=20 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    return model_dir, adapters


def test_greedy_matches_transformers_peft(case):
    model_dir, adapters = case
    prompts = [[5, 17, 99, 3, 250, 41], [400, 2, 9, 18, 77, 64, 5]]
    assigned = [name for name in [*adapters, None] for _ in prompts]
    all_prompts = prompts * (len(adapters) + 1)
    reference = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference, p, a, 8) for p, a in zip(all_prompts, assigned)]
    llm = LLM(
        model=str(model_dir),
        lora_modules={k: str(v) for k, v in adapters.items()},
        max_loras=4,
        max_lora_rank=8,
        max_model_len=64,
        block_size=8,
        dtype="float32",
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in all_prompts], params, adapters=assigned)
    for output, want, adapter in zip(outputs, expected, assigned):
        assert output.error is None, output.error
        assert output.outputs[0].token_ids == want, f"adapter {adapter}"
    # The adapters really differ from the base model (else the comparison would prove nothing).
    base = expected[-len(prompts) :]
    for i, name in enumerate(adapters):
        assert expected[i * len(prompts) : (i + 1) * len(prompts)] != base, name
