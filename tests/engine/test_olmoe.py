"""What OLMoE adds to the mixtures of experts of test_moe_models.py (which holds its greedy tokens to
transformers + PEFT, also over two ranks): q/k norms over all heads at once equal transformers' on one
rank and, each rank's sum of squares all-reduced, on several, KV heads replicated over ranks counted
once; clip_qkv, which the engine does not implement, is refused naming it."""

from __future__ import annotations

import pytest
import torch
from transformers import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

from engine.model.layers.context import BuildContext
from engine.model.layers.sharding import Split, TensorParallel
from engine.model.layers.whole_qk_norm import WholeHeadsRMSNorm
from engine.model.registry import model_class


class _Tensor:
    """A checkpoint tensor as the loaders read it."""

    name, is_float8 = "q_norm.weight", False

    def __init__(self, values: torch.Tensor):
        self.values, self.shape = values, tuple(values.shape)

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self.values[start:end]


class _Summed:
    """A process group whose all-reduce returns the sum every rank would see (precomputed), once it has
    checked that this rank hands it its own heads' sum of squares."""

    def __init__(self, total: torch.Tensor, local: torch.Tensor):
        self.total, self.local = total, local

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        torch.testing.assert_close(x, self.local)
        return self.total.clone()


def norm_on(heads: Split, rank: int, world: int, weight: torch.Tensor, group=None) -> WholeHeadsRMSNorm:
    tp = TensorParallel(rank, world, group)
    norm = WholeHeadsRMSNorm(heads, 1e-5, BuildContext(torch.float32, torch.device("cpu"), tp))
    norm.weight.weight_loader(norm.weight, _Tensor(weight), None)
    return norm


@pytest.mark.parametrize("units, world", [(4, 1), (4, 2), (2, 4)])  # split, and replicated (2 heads, 4 ranks)
def test_norm_over_all_heads_equals_transformers_over_ranks(units, world):
    head_dim, tokens = 8, 5
    heads = Split(units, head_dim, replicate=True)
    torch.manual_seed(0)
    x = torch.randn(tokens, units * head_dim)
    weight = torch.randn(units * head_dim)
    reference = OlmoeRMSNorm(units * head_dim, eps=1e-5)
    with torch.no_grad():
        reference.weight.copy_(weight)
        expected = reference(x)
    ranges = [heads.range(r, world) for r in range(world)]
    squares = [x[:, s:e].pow(2).sum(-1, keepdim=True) for s, e in ranges]  # [tokens, 1] per rank
    total = sum(squares)  # replicated heads counted on each rank that holds them
    for rank, (start, end) in enumerate(ranges):
        group = _Summed(total, squares[rank]) if world > 1 else None
        norm = norm_on(heads, rank, world, weight, group)
        local = x[:, start:end].reshape(tokens, -1, head_dim)
        torch.testing.assert_close(norm(local).reshape(tokens, -1), expected[:, start:end])


def test_clip_qkv_is_refused_naming_it():
    config = OlmoeConfig(clip_qkv=8.0, architectures=["OlmoeForCausalLM"])
    with pytest.raises(ValueError, match="clip_qkv=8.0"):
        model_class(config).check_config(config)
