"""vLLM's `load_format="dummy"` under tensor parallelism: each rank draws its own shard of random weights from
config.json alone, every parameter the shape the real checkpoint's shard has (tests/engine/test_models.py
covers one GPU and FP8)."""

from __future__ import annotations

import shutil

import pytest
import torch
from factories import make_model

from engine.model.layers.sharding import TensorParallel
from engine.model.loader import load_config, load_model


@pytest.fixture(scope="module", params=["llama", "qwen2", "phi3"])
def checkpoints(request, tmp_path_factory):
    """(a real checkpoint, a folder holding its config.json only)."""
    root = tmp_path_factory.mktemp(f"dummy-{request.param}")
    real = make_model(root / "real", arch=request.param, seed=1, vocab_size=511)
    bare = root / "bare"
    bare.mkdir()
    shutil.copy(real / "config.json", bare / "config.json")
    return real, bare


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_a_ranks_dummy_shard_has_the_real_shards_shapes(checkpoints, world_size, rank):
    real, bare = checkpoints
    config = load_config(real)
    tp = TensorParallel(rank, world_size)
    cpu = torch.device("cpu")
    loaded = load_model(real, config, torch.float32, cpu, tp=tp)
    dummy = load_model(bare, config, torch.float32, cpu, tp=tp, load_format="dummy")
    assert _shapes(dummy) == _shapes(loaded)
    weights = [p for n, p in dummy.state_dict().items() if n.endswith("down_proj.weight")]
    assert weights and all(0.01 < w.std() < 0.04 for w in weights)  # drawn (std 0.02), not left empty
