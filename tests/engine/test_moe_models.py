"""Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE and GLM-4.5 against transformers + PEFT on tiny random checkpoints (8
experts, top 2, float32, CPU; GLM-4.5's in 4 groups of which 2 are kept): greedy tokens identical with
adapters on attention only, on the routed experts only (PEFT's target_parameters on the stacked expert
weights) and on both (Qwen2-MoE, GLM-4.5: on the shared expert alone and on everything too), mixed in one
batch with base-model requests, through chunked prefill with prefix-cache hits; from the hub's per-expert
checkpoint layout and from transformers 5's fused one; on the Triton path (interpreted)."""

from __future__ import annotations

import random

import pytest
import torch
from factories import make_adapter, make_model, moe_adapters, per_adapter_reference
from safetensors.torch import load_file, save_file

from adapter_format.checkpoint import load_peft_adapter
from engine import LLM, SamplingParams, model_shape
from engine.model.loader import load_config

NUM_NEW_TOKENS = 8
ARGS = dict(max_loras=3, max_lora_rank=16, block_size=4, max_model_len=64, dtype="float32")
CHUNKED = dict(max_num_seqs=8, max_num_batched_tokens=8, enable_prefix_caching=True)


def greedy(n: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


@torch.inference_mode()
def expected_tokens(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def fuse_experts(model_dir, out_dir):
    """The checkpoint rewritten in transformers 5's fused layout: per layer `mlp.experts.gate_up_proj`
    [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (Mixtral's block_sparse_moe renamed to mlp)."""
    import shutil

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    fused, per_layer = {}, {}
    for name, tensor in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, part, _ = rest.split(".")
            part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(part, part)
            per_layer.setdefault(prefix, {}).setdefault(part, {})[int(expert)] = tensor
        else:
            fused[name] = tensor
    for prefix, parts in per_layer.items():
        order = sorted(parts["gate_proj"])
        gate_up = [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in order]
        fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts["down_proj"][e] for e in order])
    (out_dir / "model.safetensors").unlink()
    save_file(fused, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe"])
def case(request, tmp_path_factory):
    return build_case(request.param, tmp_path_factory.mktemp(f"moe-{request.param}"))


def build_case(arch: str, root) -> dict:
    """A tiny `arch` checkpoint, its test adapters, 8 prompts (half sharing a prefix) each on an adapter
    or none, and transformers + PEFT's greedy tokens for them (each adapter checked to change them)."""
    model_dir = make_model(root / "model", arch=arch, seed=1)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=20 + i, **kwargs)
        for i, (name, kwargs) in enumerate(moe_adapters(arch).items())
    }
    rng = random.Random(arch)
    shared = [rng.randrange(3, 512) for _ in range(10)]
    prompts = [
        (shared if i % 2 else [])
        + [rng.randrange(3, 512) for _ in range(rng.randrange(12, 20) - 10 * (i % 2))]
        for i in range(8)
    ]
    names = [*adapters, None]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    references = per_adapter_reference(model_dir, adapters)
    expected = [expected_tokens(references[a], p, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    for prompt, adapter, tokens in zip(prompts, assigned, expected):  # each adapter changes the answer
        if adapter is not None:
            assert tokens != expected_tokens(references[None], prompt, NUM_NEW_TOKENS), adapter
    return dict(
        arch=arch, root=root, model_dir=model_dir, adapters=adapters, prompts=prompts, assigned=assigned,
        expected=expected, references=references,
    )  # fmt: skip


def generate(llm, case, params=None, count=None):
    prompts, assigned = case["prompts"][:count], case["assigned"][:count]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(), adapters=assigned)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(case, model_dir=None, **kwargs):
    lora_modules = {k: str(v) for k, v in case["adapters"].items()}
    return LLM(model=str(model_dir or case["model_dir"]), lora_modules=lora_modules, **{**ARGS, **kwargs})


def test_adapters_on_experts_are_read_per_expert(case):
    """PEFT's nested wrappers resolve to the stacked weight their shapes fit, whatever the nesting."""
    shape = model_shape(load_config(case["model_dir"]))
    experts = shape.targets.index("experts.gate_up_proj")
    assert shape.targets[experts : experts + 2] == ("experts.gate_up_proj", "experts.down_proj")
    adapter = load_peft_adapter(case["adapters"]["both_r16"], shape, 16)
    first = min(layer for layer, module in adapter.modules if module == "experts.gate_up_proj")
    assert first == (1 if case["arch"] == "glm4_moe" else 0)  # GLM-4.5's first layer is dense
    pair = adapter.modules[(first, "experts.gate_up_proj")]
    assert pair.lora_a.shape == (8, 16, shape.hidden_size)
    assert pair.lora_b.shape == (8, 2 * shape.moe_intermediate_size, 16)
    assert adapter.modules[(shape.num_layers - 1, "experts.down_proj")].lora_a.shape == (
        8,
        16,
        shape.moe_intermediate_size,
    )


def test_greedy_matches_transformers_peft(case):
    llm = make_llm(case, **CHUNKED)
    assert generate(llm, case) == case["expected"]
    assert llm.engine.stats().num_prefix_cache_hits > 0


def test_fused_checkpoint_layout(case):
    fused = fuse_experts(case["model_dir"], case["root"] / "fused")
    assert generate(make_llm(case, fused, max_num_seqs=8), case) == case["expected"]


@pytest.mark.slow
@pytest.mark.interpreted
def test_triton_path_matches(case):
    """The fused-MoE kernels (interpreted) with the expert LoRA deltas: the tokens of the torch path.
    (Mixtral's layers run the same kernels; interpreting costs CI time.)"""
    if case["arch"] == "mixtral":
        pytest.skip("Qwen3-MoE runs the same kernels")  # Qwen2-MoE adds the shared expert's fused ops
    short = {**case, "prompts": [p[:8] for p in case["prompts"]]}
    count = len(case["adapters"]) + 1  # one request per adapter and one without
    torch_path = generate(make_llm(case, max_num_seqs=4), short, greedy(3), count=count)
    triton_path = generate(
        make_llm(case, max_num_seqs=4, attention_backend="triton"), short, greedy(3), count
    )
    assert triton_path == torch_path


def test_routing_counts_every_token_each_moe_layer_routes(case):
    """Tokens per expert since the start (the metrics' source): each forwarded token counts top_k times
    per MoE layer (Qwen3-MoE's dense layer counts nothing)."""
    llm = make_llm(case, max_num_seqs=4, enable_prefix_caching=False)
    prompts = case["prompts"][:3]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4))
    assert all(o.error is None for o in outputs)
    model = llm.engine.runner.model
    forwarded = sum(len(p) for p in prompts) + len(prompts) * (4 - 1)  # the last token is never fed back
    stats = llm.engine.stats()
    assert len(stats.moe_expert_tokens) == 8
    assert sum(stats.moe_expert_tokens) == forwarded * 2 * len(model.moe_layers)
    assert stats.moe_load_imbalance >= 1.0


def write_per_expert_adapter(case, path, rank=4, alpha=8):
    """An adapter as PEFT saved it on transformers 4, whose experts were Linear modules: a pair per expert
    and projection (Mixtral's w1/w3/w2 under block_sparse_moe), on every other expert. Returns it and the
    per-expert updates {(layer, expert, 0 gate | 1 up | 2 down): scale * B @ A}."""
    import json

    config = load_config(case["model_dir"])
    mixtral = case["arch"] == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if mixtral else "mlp"
    h = config.hidden_size
    inter = (
        getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    )  # Mixtral, OLMoE: the latter
    gen = torch.Generator().manual_seed(99)
    tensors, updates = {}, {}
    moe_layers = [
        i
        for i in range(config.num_hidden_layers)
        if i not in (getattr(config, "mlp_only_layers", None) or [])
        and i >= (getattr(config, "first_k_dense_replace", None) or 0)  # GLM-4.5's dense first layers
    ]
    for layer in moe_layers:
        for expert in range(0, 8, 2):
            for part, name in enumerate(names):
                cols, out = (inter, h) if part == 2 else (h, inter)
                a = torch.randn(rank, cols, generator=gen) * 0.3
                b = torch.randn(out, rank, generator=gen) * 0.3
                prefix = f"base_model.model.model.layers.{layer}.{block}.experts.{expert}.{name}"
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
                updates[(layer, expert, part)] = alpha / rank * b @ a
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, target_modules=list(names)
    )
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path, updates


def test_per_expert_target_modules_of_older_peft(case):
    """Per-expert pairs (older PEFT) fold into the stacked experts' pairs: the tokens of transformers with
    each update merged into its expert's weights, mixed with base-model requests."""
    from transformers import AutoModelForCausalLM

    path, updates = write_per_expert_adapter(case, case["root"] / "per_expert")
    merged = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32).eval()
    with torch.no_grad():
        for (layer, expert, part), delta in updates.items():
            experts = merged.model.layers[layer].mlp.experts
            if part == 2:
                experts.down_proj[expert] += delta
            else:
                inter = delta.shape[0]
                experts.gate_up_proj[expert, part * inter : (part + 1) * inter] += delta
    prompts = case["prompts"][:4]
    assigned = ["old", None, "old", "old"]
    references = per_adapter_reference(case["model_dir"], {})
    expected = [
        expected_tokens(merged if a else references[None], p, NUM_NEW_TOKENS)
        for p, a in zip(prompts, assigned)
    ]
    assert expected[0] != expected_tokens(references[None], prompts[0], NUM_NEW_TOKENS)
    llm = LLM(model=str(case["model_dir"]), lora_modules={"old": str(path)}, **{**ARGS, "max_num_seqs": 4})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), adapters=assigned)
    assert [o.outputs[0].token_ids for o in outputs] == expected
