"""Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers + PEFT on tiny random checkpoints (float32, CPU):
greedy tokens identical with adapters of different ranks and target sets (one `target_modules="all-linear"`)
mixed in one batch with requests that use none, through chunked prefill with prefix-cache hits, through
preemption, and on the Triton path (interpreted). Gemma's prompts are longer than its 8-token window, so
its local layers mask; Phi-3's adapters target its fused qkv_proj and gate_up_proj."""

from __future__ import annotations

import json
import random

import pytest
from factories import family_adapters, load_peft_reference, make_adapter, make_model, reference_greedy

import engine.model.layers.attention as attention_block
from adapter_format.checkpoint import load_peft_adapter
from engine import LLM, SamplingParams, model_shape
from engine.model.attention import write_kv
from engine.model.kv_quant import dequantize_fp8, quantize_fp8
from engine.model.loader import load_config

FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3")
NUM_NEW_TOKENS = 10
ARGS = dict(max_loras=3, max_lora_rank=16, block_size=4, max_model_len=64, dtype="float32")
SETTINGS = {
    # 8 tokens a step: every prompt is prefilled in chunks beside other requests' decodes; the prompts
    # sharing a 12-token prefix find its blocks cached.
    "chunked_prefill_prefix_cache": dict(
        max_num_seqs=8, max_num_batched_tokens=8, enable_prefix_caching=True
    ),
    # 12 blocks of 4 tokens cannot hold 8 sequences of up to 40 tokens: requests are preempted.
    "preemption": dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=12, max_model_len=48),
}


def greedy(max_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"models-{arch}")
    model_dir = make_model(root / "model", arch=arch, seed=1)
    adapters = {
        name: make_adapter(model_dir, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(family_adapters(arch).items())
    }
    rng = random.Random(arch)
    shared = [rng.randrange(3, 512) for _ in range(12)]
    # 8 prompts of 17..30 tokens (past Gemma's window and Phi-3's original 16 positions); 4 share a prefix.
    prompts = [
        (shared if i % 2 else [])
        + [rng.randrange(3, 512) for _ in range(rng.randrange(17, 31) - 12 * (i % 2))]
        for i in range(8)
    ]
    names = [*adapters, None]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    reference = load_peft_reference(model_dir, adapters)
    expected = [reference_greedy(reference, p, a, NUM_NEW_TOKENS) for p, a in zip(prompts, assigned)]
    return dict(
        arch=arch,
        model_dir=model_dir,
        adapters=adapters,
        prompts=prompts,
        assigned=assigned,
        expected=expected,
    )


def generate(llm, case, params=None, count=None):
    prompts, assigned = case["prompts"][:count], case["assigned"][:count]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(), adapters=assigned)
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(case, **kwargs):
    lora_modules = {k: str(v) for k, v in case["adapters"].items()}
    return LLM(model=str(case["model_dir"]), lora_modules=lora_modules, **{**ARGS, **kwargs})


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_matches_transformers_peft(case, setting):
    llm = make_llm(case, **SETTINGS[setting])
    assert generate(llm, case) == case["expected"]
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV cache was meant to force preemption"
    else:
        assert llm.engine.stats().num_prefix_cache_hits > 0, "the shared prefix was meant to hit the cache"


@pytest.mark.slow
@pytest.mark.interpreted
def test_triton_path_matches(case):
    """The fused kernels (q/k norm with RoPE, Gemma's norms, GeGLU, partial rotary, soft caps) and the
    Triton attention with its sliding window, interpreted: the tokens of the torch path (which matches
    transformers + PEFT above) on two 12-token prompts, past Gemma's window. (Qwen3's q/k norm kernel is
    Gemma 3's without the offset: test_fused_ops covers both; interpreting costs CI time.)"""
    if case["arch"] == "qwen3":
        pytest.skip("Gemma 3 runs the same kernels")
    short = {**case, "prompts": [p[:12] for p in case["prompts"][:2]]}
    args = dict(max_num_seqs=4, max_num_batched_tokens=64)
    torch_path = generate(make_llm(case, **args), short, greedy(3), count=2)
    assert (
        generate(make_llm(case, attention_backend="triton", **args), short, greedy(3), count=2) == torch_path
    )


def test_all_linear_adapter_targets_every_projection(case):
    """PEFT saves "all-linear" as every projection's full path; the adapter covers all the family's targets."""
    config = json.loads((case["adapters"]["all_r16"] / "adapter_config.json").read_text())
    assert any(t.startswith("model.layers.") for t in config["target_modules"])
    shape = model_shape(load_config(case["model_dir"]))
    fused = case["arch"] == "phi3"
    assert shape.targets == (
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        if fused
        else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    assert load_peft_adapter(case["adapters"]["all_r16"], shape, 16).target_modules == shape.targets


def test_dummy_weights_need_only_the_config(tmp_path):
    """vLLM's load_format="dummy": a shape to benchmark from config.json alone, FP8 included."""
    model_dir = make_model(tmp_path / "model", arch="gemma3", seed=0)
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    for quantization in (None, "fp8"):
        llm = LLM(
            model=str(model_dir),
            load_format="dummy",
            quantization=quantization,
            dtype="float32",
            block_size=4,
        )
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(3))
        assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        LLM(model=str(model_dir), load_format="pt")


def test_speculative_decoding_keeps_the_greedy_tokens(case):
    """n-gram proposals verified with each request's adapter (Gemma's soft caps and windows included)."""
    prompts = [p[:6] + [7, 8, 9, 10] * 4 for p in case["prompts"][:4]]  # the last tokens occurred before
    repetitive = {**case, "prompts": prompts}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)  # no min_tokens
    plain = generate(make_llm(case, max_num_seqs=4), repetitive, params, count=4)
    llm = make_llm(case, max_num_seqs=4, speculative_config=spec)
    assert generate(llm, repetitive, params, count=4) == plain
    assert llm.engine.speculator.stats().num_draft_tokens > 0


def test_fp8_kv_cache_computes_what_a_rounded_cache_does(case, monkeypatch):
    """An fp8 KV cache gives the tokens of the model-dtype cache holding K/V rounded through e4m3."""
    fp8 = generate(make_llm(case, max_num_seqs=4, kv_cache_dtype="fp8"), case, count=4)

    def write_rounded(key_cache, value_cache, k, v, slots, k_scale, v_scale):
        k = dequantize_fp8(quantize_fp8(k, k_scale), k_scale, k.dtype)
        v = dequantize_fp8(quantize_fp8(v, v_scale), v_scale, v.dtype)
        write_kv(key_cache, value_cache, k, v, slots)

    monkeypatch.setattr(attention_block, "write_kv", write_rounded)
    assert generate(make_llm(case, max_num_seqs=4), case, count=4) == fp8
