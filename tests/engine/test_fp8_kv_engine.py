"""fp8 KV cache, engine level: validation, the memory budget, checkpoint scales, and generation that equals
an engine whose cache holds the same rounded values, stays close to the model-dtype cache, and keeps prefix
caching, preemption and the Triton backend (interpreted) unchanged."""

from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch
from factories import make_model
from safetensors.torch import load_file, save_file

import engine.model.layers.attention as attention_block
from engine import LLM, EngineConfig, SamplingParams
from engine.model.attention import write_kv
from engine.model.kv_quant import FP8_DTYPE, dequantize_fp8, quantize_fp8
from engine.model.loader import load_config, load_model

NUM_NEW_TOKENS = 16
# Calibrated-like per-layer scales: K/V of this model peak at about 6 and 7 (amax / 448 ~ 0.015).
CHECKPOINT_SCALES = [(0.02, 0.015), (0.025, 0.02)]  # (k_scale, v_scale) of layers 0 and 1
# Scales so coarse that K/V land among e4m3's subnormals (steps of 2^-9 x 1000, about 2, for entries of
# about +-2): a garbage cache, mostly zeros, to show that the closeness checks below would catch one.
BROKEN_SCALES = [(1000.0, 1000.0), (1000.0, 1000.0)]


def with_kv_scales(model_dir, path, scales, names=("self_attn.k_scale", "self_attn.v_scale")):
    """A copy of `model_dir` whose safetensors also hold per-layer KV scales under `names`."""
    shutil.copytree(model_dir, path)
    tensors = load_file(path / "model.safetensors")
    for i, (k_scale, v_scale) in enumerate(scales):
        for name, value in zip(names, (k_scale, v_scale)):
            tensors[f"model.layers.{i}.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-engine")
    plain = make_model(root / "plain", arch="llama", seed=2)
    return {
        "plain": plain,
        "scaled": with_kv_scales(plain, root / "scaled", CHECKPOINT_SCALES),
        "broken": with_kv_scales(plain, root / "broken", BROKEN_SCALES),
    }


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(3, 41))] for _ in range(8)]


def make_llm(model_dir, kv_cache_dtype="auto", **kwargs):
    args = dict(
        max_model_len=128,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        dtype="float32",
        device="cpu",
    )  # CPU tests (interpreted Triton); the GPU runs are in test_cuda_graphs.py
    return LLM(
        model=str(model_dir), skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype, **{**args, **kwargs}
    )


def generate(llm, prompts, logprobs=20):
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, logprobs=logprobs
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(o.error is None for o in outputs)
    return [o.outputs[0] for o in outputs]


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(model="m", kv_cache_dtype="int8")
    assert EngineConfig(model="m").kv_cache_torch_dtype(torch.bfloat16) == torch.bfloat16
    for name in ("fp8", "fp8_e4m3"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_torch_dtype(torch.bfloat16) == FP8_DTYPE


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
def test_fp8_blocks_fit_the_budget_by_element_size(models, dtype, ratio, caplog):
    # One fp32 block: 2 layers x K and V x 8 tokens x 2 KV heads x 16 dims x 4 bytes = 4 KiB; max_num_seqs
    # 16 x 16 blocks per sequence keeps the cap on useful blocks (256) out of the way.
    budget = dict(cpu_kv_cache_bytes=32 * 4096, max_num_seqs=16, dtype=dtype)
    auto = make_llm(models["plain"], **budget).engine.runner
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        fp8 = make_llm(models["plain"], "fp8", **budget).engine.runner
    assert fp8.num_kv_blocks == ratio * auto.num_kv_blocks
    assert fp8.kv_block_bytes * ratio == auto.kv_block_bytes
    assert all(k.dtype == v.dtype == FP8_DTYPE for k, v in fp8.kv_caches)
    assert all(k.dtype == getattr(torch, dtype) for k, _ in auto.kv_caches)
    assert "float8_e4m3fn (fp8, per-tensor scales 1.0: none in the checkpoint)" in caplog.text


@pytest.mark.parametrize(
    "names",
    [
        ("self_attn.k_scale", "self_attn.v_scale"),  # llm-compressor, vLLM
        ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
        ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
        ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),  # AutoFP8
    ],
)
def test_checkpoint_scales_are_loaded(models, tmp_path, names):
    path = with_kv_scales(models["plain"], tmp_path / "m", CHECKPOINT_SCALES, names)
    model = load_model(path, load_config(path), torch.float32, torch.device("cpu"))
    assert model.kv_scales_from_checkpoint
    attention = [layer.self_attn for layer in model.model.layers]
    loaded = [s.item() for a in attention for s in (a.k_scale, a.v_scale)]
    assert loaded == pytest.approx([s for pair in CHECKPOINT_SCALES for s in pair])
    assert all(a.k_scale.dtype == torch.float32 and a.k_scale.shape == (1,) for a in attention)


def test_legacy_kv_scale_serves_k_and_v_and_defaults_are_one(models, tmp_path):
    legacy = ("self_attn.kv_scale", "self_attn.kv_scale")
    path = with_kv_scales(models["plain"], tmp_path / "m", [(0.5, 0.5)], legacy)
    model = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"))
    first, second = (layer.self_attn for layer in model.model.layers)
    assert (first.k_scale.item(), first.v_scale.item()) == (0.5, 0.5)
    assert (second.k_scale.item(), second.v_scale.item()) == (1.0, 1.0)  # layer 1 has none
    plain = load_model(models["plain"], load_config(models["plain"]), torch.float32, torch.device("cpu"))
    assert not plain.kv_scales_from_checkpoint


@pytest.mark.parametrize("bad", [0.0, [0.1, 0.2]])
def test_bad_checkpoint_scales_are_refused(models, tmp_path, bad):
    path = with_kv_scales(models["plain"], tmp_path / "m", [(bad, 1.0)])
    with pytest.raises(ValueError, match="one positive number"):
        load_model(path, load_config(path), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("model", ["plain", "scaled"])
def test_fp8_engine_equals_a_cache_holding_the_rounded_values(models, prompts, model, monkeypatch):
    """The fp8 engine computes exactly what the model-dtype engine computes when K/V are rounded through e4m3
    with the same scales before they are stored: the scales are applied once on each side, and nothing else
    differs."""
    fp8 = generate(make_llm(models[model], "fp8"), prompts)

    def write_rounded(key_cache, value_cache, k, v, slots, k_scale, v_scale):
        k = dequantize_fp8(quantize_fp8(k, k_scale), k_scale, k.dtype)
        v = dequantize_fp8(quantize_fp8(v, v_scale), v_scale, v.dtype)
        write_kv(key_cache, value_cache, k, v, slots)

    monkeypatch.setattr(attention_block, "write_kv", write_rounded)
    rounded = generate(make_llm(models[model], "auto"), prompts)
    assert [o.token_ids for o in fp8] == [o.token_ids for o in rounded]
    for a, b in zip(fp8, rounded):
        assert a.logprobs[0].top == pytest.approx(b.logprobs[0].top, abs=1e-4)


def first_step_drift(reference, outputs) -> tuple[float, int, int]:
    """(mean |logprob change| of each prompt's top-5 reference tokens at the first generated token,
    how many of those fell out of the top 20, prompts whose first token changed)."""
    changes, missing = [], 0
    for ref, out in zip(reference, outputs):
        ref_top, top = ref.logprobs[0].top, out.logprobs[0].top
        for token in sorted(ref_top, key=ref_top.get, reverse=True)[:5]:
            if token in top:
                changes.append(abs(ref_top[token] - top[token]))
            else:
                missing += 1
    flipped = sum(ref.token_ids[0] != out.token_ids[0] for ref, out in zip(reference, outputs))
    return sum(changes) / max(1, len(changes)), missing, flipped


def test_fp8_stays_close_to_the_model_dtype_cache(models, prompts):
    """Measured on this random model (flat distributions: top-2 logprobs often within 0.1): the first-step
    top-5 logprobs move by 0.12 (scales 1.0) and 0.09 (checkpoint scales) on average, none leaves the top
    20, at most 1 of 8 first tokens flips; 38% and 27% of the 128 greedy tokens match position for
    position (greedy paths part after the first flip). Broken caches fail every check: the garbage cache
    of BROKEN_SCALES drifts 0.97 with 28 of 40 top-5 tokens out of the top 20 and all 8 first tokens
    flipped; K and V scales off by 1.5x on read drift 0.45 with 8 out and 3 flipped; a read that ignores
    the scales, 37 out and 8 flipped."""
    auto = generate(make_llm(models["plain"]), prompts)
    for model in ("plain", "scaled"):
        drift, missing, flipped = first_step_drift(auto, generate(make_llm(models[model], "fp8"), prompts))
        assert drift < 0.2 and missing == 0 and flipped <= 2, (model, drift, missing, flipped)
    drift, missing, flipped = first_step_drift(auto, generate(make_llm(models["broken"], "fp8"), prompts))
    assert missing > 10 and flipped > 4, "the checks above should fail for a garbage cache"


def test_prefix_caching_and_preemption_unchanged(models):
    """fp8 blocks are reused by the prefix cache and recomputed after preemption with the same bytes."""
    rng = random.Random(9)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    roomy = make_llm(models["scaled"], "fp8", enable_prefix_caching=False, num_kv_blocks=64, max_model_len=64)
    plain = generate(roomy, prompts, None)
    # 8 blocks of 8 tokens cannot hold 4 running sequences of up to 47 tokens.
    llm = make_llm(models["scaled"], "fp8", enable_prefix_caching=True, num_kv_blocks=8, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [o.token_ids for o in plain]


@pytest.mark.slow
@pytest.mark.interpreted
def test_triton_backend_fp8_matches_torch_backend_fp8(models, prompts):
    """Interpreted Triton kernels read the float8 cache like the torch path: the same greedy tokens."""
    torch_path = generate(make_llm(models["scaled"], "fp8", attention_backend="torch"), prompts[:3], None)
    triton_path = generate(make_llm(models["scaled"], "fp8", attention_backend="triton"), prompts[:3], None)
    assert [o.token_ids for o in triton_path] == [o.token_ids for o in torch_path]
