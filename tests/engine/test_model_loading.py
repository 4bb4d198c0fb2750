"""Checkpoint loading: sharded safetensors, RoPE scaling variants against transformers, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from factories import load_peft_reference, make_model, reference_greedy
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams

PROMPTS = [[5, 17, 300, 42, 8, 99, 123, 7, 256, 11] * 3, [400, 3, 77]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


def _engine_tokens(model_dir, **kwargs):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=8, dtype="float32", **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


ROPE_VARIANTS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(tmp_path, variant):
    model_dir = make_model(tmp_path / "m", seed=4, rope_scaling=ROPE_VARIANTS[variant], rope_theta=500000.0)
    reference = load_peft_reference(model_dir, {})
    assert _engine_tokens(model_dir) == [reference_greedy(reference, p, None, 12) for p in PROMPTS]


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single = make_model(tmp_path / "single", seed=5)
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB", safe_serialization=True)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert _engine_tokens(tmp_path / "sharded") == _engine_tokens(single)


def test_pickled_checkpoint_is_refused(tmp_path):
    model_dir = make_model(tmp_path / "m")
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    torch.save({}, model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled checkpoints are not loaded"):
        LLM(model=str(model_dir))


def test_unsupported_architecture_is_named(tmp_path):
    model_dir = make_model(tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises((ValueError, KeyError), match="gpt2|GPT2"):
        LLM(model=str(model_dir))


def test_kv_cache_smaller_than_max_model_len_is_refused(tmp_path):
    model_dir = make_model(tmp_path / "m")
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(model=str(model_dir), num_kv_blocks=4, block_size=4, max_model_len=64)


CONFIG_ERRORS = {
    "max_num_seqs": (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    "block_size": (dict(block_size=-1), "block_size must be a positive integer"),
    "max_loras": (dict(max_loras=0), "max_loras must be a positive integer"),
    "max_lora_rank": (dict(max_lora_rank=1.5), "max_lora_rank must be a positive integer"),
    "lora_pool_rank_budget": (dict(lora_pool_rank_budget=0), "lora_pool_rank_budget must be a positive"),
    "lora_pool_below_max_rank": (
        dict(max_lora_rank=64, lora_pool_rank_budget=32),
        "must hold one adapter of the largest rank",
    ),
    "num_kv_blocks": (dict(num_kv_blocks=1), "num_kv_blocks must be at least 2"),
    "utilization": (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
    "dtype": (dict(dtype="int8"), "dtype must be 'auto' or one of"),
    "device": (dict(device="warp-drive"), "is not a torch device"),
    "max_model_len": (dict(max_model_len=0), "max_model_len must be a positive integer"),
    "no_chunking_too_small": (
        dict(max_model_len=512, max_num_batched_tokens=256, enable_chunked_prefill=False),
        "max_num_batched_tokens",
    ),
}


@pytest.mark.parametrize("kwargs, message", CONFIG_ERRORS.values(), ids=CONFIG_ERRORS.keys())
def test_engine_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", **kwargs)
