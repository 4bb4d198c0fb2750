"""Merged adapters (adapter_format/merge.py) served by the engine: greedy tokens identical to PEFT's
`add_weighted_adapter` result (same method, weights, density and, for DARE, the same seed) in float32,
every merge in one batch with a plain adapter and the base model; and the refusals."""

from __future__ import annotations

import random

import pytest
import torch
from factories import load_peft_reference, make_adapter, make_model, reference_greedy

from adapter_format.merge import (
    MergeError,
    MergeMethod,
    check_parts,
    load_part,
    merge_adapters,
    write_merged_folder,
)
from engine import LLM, SamplingParams, model_shape
from engine.model.loader import load_config

NUM_NEW_TOKENS = 10
MAX_RANK = 16

ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]),
    "c": dict(r=4, lora_alpha=8, target_modules="all-linear"),
}
# name -> (parts, weights, method); DARE's seeds are each case's own (merge_seed in the server)
MERGES = {
    "linear": (["a", "b"], [0.7, 0.5], MergeMethod("linear")),
    "ties": (["a", "b"], [1.0, -0.6], MergeMethod("ties", density=0.5)),
    "dare_linear": (["a", "b"], [0.8, 0.9], MergeMethod("dare_linear", density=0.6)),
    "dare_ties": (
        ["b", "a"],
        [1.2, 0.4],
        MergeMethod("dare_ties", density=0.7, majority_sign_method="frequency"),
    ),
    "cat": (["a", "c"], [0.8, 1.5], MergeMethod("cat")),
}
SEEDS = {name: 1000 + i for i, name in enumerate(MERGES)}


def peft_merged_greedy(model_dir, adapters, prompts) -> dict[str, list[list[int]]]:
    """{merge: tokens per prompt} from PEFT's add_weighted_adapter on the same parts."""
    model = load_peft_reference(model_dir, adapters)
    lora_model = model.base_model
    inject = lora_model.inject_adapter
    expected = {}
    for name, (parts, weights, method) in MERGES.items():
        # PEFT draws DARE's masks from torch's global generator after initialising the new adapter: seed
        # it there, so its masks are the ones the merge draws from its own generator with this seed.
        def seeded_inject(*args, _seed=SEEDS[name], **kwargs):
            inject(*args, **kwargs)
            torch.manual_seed(_seed)

        lora_model.inject_adapter = seeded_inject
        model.add_weighted_adapter(
            parts,
            weights,
            name,
            combination_type=method.method,
            density=method.density,
            majority_sign_method=method.majority_sign_method,
        )
        lora_model.inject_adapter = inject
        expected[name] = [reference_greedy(model, p, name, NUM_NEW_TOKENS) for p in prompts]
    expected["a"] = [reference_greedy(model, p, "a", NUM_NEW_TOKENS) for p in prompts]
    expected[None] = [reference_greedy(model, p, None, NUM_NEW_TOKENS) for p in prompts]
    return expected


@pytest.fixture(scope="module")
def merge_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("merges")
    model_dir = make_model(root / "model", seed=4)
    adapters = {
        n: make_adapter(model_dir, root / n, seed=40 + i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())
    }
    shape = model_shape(load_config(model_dir))
    merged = {}
    for name, (parts, weights, method) in MERGES.items():
        loaded = [load_part(adapters[p], p, w, shape, MAX_RANK) for p, w in zip(parts, weights)]
        config, tensors = merge_adapters(loaded, method, shape, MAX_RANK, SEEDS[name])
        write_merged_folder(root / f"merged-{name}", config, tensors)
        merged[name] = root / f"merged-{name}"
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 20))] for _ in range(2)]
    return dict(
        model_dir=model_dir,
        adapters=adapters,
        merged=merged,
        shape=shape,
        prompts=prompts,
        expected=peft_merged_greedy(model_dir, adapters, prompts),
    )


def test_merged_adapters_match_peft_add_weighted_adapter(merge_case):
    llm = LLM(
        model=str(merge_case["model_dir"]),
        lora_modules={"a": str(merge_case["adapters"]["a"])}
        | {k: str(v) for k, v in merge_case["merged"].items()},
        max_loras=4,  # fewer slots than adapters: merged adapters take and give back slots like others
        max_lora_rank=MAX_RANK,
        block_size=8,
        max_model_len=128,
        dtype="float32",
        max_num_seqs=16,
    )
    names = [*MERGES, "a", None]
    prompts = [p for _ in names for p in merge_case["prompts"]]
    assigned = [n for n in names for _ in merge_case["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=assigned)
    got: dict = {}
    for output, name in zip(outputs, assigned):
        assert output.error is None, output.error
        got.setdefault(name, []).append(output.outputs[0].token_ids)
    for name in names:
        assert got[name] == merge_case["expected"][name], f"merge {name}"
    # the merges differ from one another and from their parts (a test that could not fail otherwise)
    assert len({str(got[n]) for n in names}) == len(names)


def test_same_spec_same_adapter_and_dare_seed_matters(merge_case):
    shape, adapters = merge_case["shape"], merge_case["adapters"]
    parts = [load_part(adapters[p], p, w, shape, MAX_RANK) for p, w in zip(["a", "b"], [0.8, 0.9])]
    method = MergeMethod("dare_linear", density=0.5)
    _, first = merge_adapters(parts, method, shape, MAX_RANK, seed=5)
    _, again = merge_adapters(parts, method, shape, MAX_RANK, seed=5)
    _, other = merge_adapters(parts, method, shape, MAX_RANK, seed=6)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_refusals(merge_case, tmp_path):
    shape, adapters = merge_case["shape"], merge_case["adapters"]

    def parts(*names):
        return [load_part(adapters[n], n, 1.0, shape, MAX_RANK) for n in names]

    with pytest.raises(MergeError, match="one rank only.*a \\(r=8\\), c \\(r=4\\)"):
        check_parts(parts("a", "c"), MergeMethod("linear"), MAX_RANK)
    with pytest.raises(MergeError, match="sum of the ranks \\(8 \\+ 8 \\+ 4 = 20\\)"):
        check_parts(parts("a", "b", "c"), MergeMethod("cat"), MAX_RANK)
    assert check_parts(parts("a", "c"), MergeMethod("cat"), MAX_RANK) == 12
    other_base = parts("a")[0]
    other_base = type(other_base)(
        "x", other_base.adapter, {**other_base.config, "base_model_name_or_path": "other/model"}, 1.0
    )
    with pytest.raises(MergeError, match="different base models"):
        check_parts([*parts("b"), other_base], MergeMethod("linear"), MAX_RANK)
    dora = type(other_base)("d", other_base.adapter, {**parts("a")[0].config, "use_dora": True}, 1.0)
    with pytest.raises(MergeError, match="DoRA"):
        check_parts([dora], MergeMethod("linear"), MAX_RANK)
    embedding = type(other_base)(
        "e",
        other_base.adapter,
        {**dora.config, "use_dora": False, "target_modules": ["q_proj", "embed_tokens"]},
        1.0,
    )
    with pytest.raises(MergeError, match="embed_tokens or lm_head"):
        check_parts([embedding], MergeMethod("linear"), MAX_RANK)
