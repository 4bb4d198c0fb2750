"""vLLM's `load_format="dummy"`: random weights of the checkpoint's shapes, whole or one rank's shard, from
config.json alone; the same tensors, shape for shape, as loading the real checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
from factories import make_model

from adapter_format.model_shape import ModelShape
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model.loader import load_config, load_weights
from engine.model.weight_source import DUMMY_STD
from engine.parallel.plan import ShardPlan
from engine.parallel.sharded_loader import load_shard


def _tensors(weights) -> list[torch.Tensor]:
    out = [weights.embed, weights.norm, weights.lm_head]
    for layer in weights.layers:
        out += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        out += [layer.qkv_bias] if layer.qkv_bias is not None else []
    return out


@pytest.fixture(
    scope="module", params=[("llama", {}), ("qwen2", {"tie_word_embeddings": True})], ids=["llama", "qwen2"]
)
def checkpoints(request, tmp_path_factory):
    """(a real checkpoint, a folder holding its config.json only)."""
    arch, overrides = request.param
    root = tmp_path_factory.mktemp(f"dummy-{arch}")
    real = make_model(root / "real", arch=arch, seed=1, vocab_size=511, **overrides)
    bare = root / "bare"
    bare.mkdir()
    shutil.copy(real / "config.json", bare / "config.json")
    return real, bare


def test_dummy_weights_have_the_checkpoints_shapes(checkpoints):
    real, bare = checkpoints
    config = load_config(real)
    loaded = load_weights(real, config, torch.float32, torch.device("cpu"))
    dummy = load_weights(bare, config, torch.float32, torch.device("cpu"), load_format="dummy")
    again = load_weights(bare, config, torch.float32, torch.device("cpu"), load_format="dummy")
    assert [t.shape for t in _tensors(dummy)] == [t.shape for t in _tensors(loaded)]
    assert all(torch.equal(a, b) for a, b in zip(_tensors(dummy), _tensors(again)))  # reproducible
    assert torch.all(dummy.norm == 1) and 0.5 * DUMMY_STD < dummy.layers[0].down.std() < 2 * DUMMY_STD
    assert (dummy.lm_head is dummy.embed) == (loaded.lm_head is loaded.embed)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_dummy_shard_has_the_shards_shapes(checkpoints, rank):
    real, bare = checkpoints
    config = load_config(real)
    plan = ShardPlan(ModelShape.from_hf_config(config), config.vocab_size, 2)
    args = (config, plan, rank, torch.float32, torch.device("cpu"))
    loaded, dummy = load_shard(real, *args), load_shard(bare, *args, load_format="dummy")
    assert [t.shape for t in _tensors(dummy)] == [t.shape for t in _tensors(loaded)]


def test_an_engine_serves_dummy_weights_from_config_alone(checkpoints):
    _, bare = checkpoints
    with LLM(model=str(bare), load_format="dummy", skip_tokenizer_init=True, max_model_len=64) as llm:
        (output,) = llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True)
        )
    assert len(output.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, dummy"):
        EngineConfig(model=str(bare), load_format="pt")
