"""What OLMoE adds to the mixtures of experts of test_moe_models.py (which holds its greedy tokens to
transformers + PEFT, also over two ranks): q/k norms over all heads at once equal transformers' on one
rank and, each rank's sum of squares all-reduced (q's and k's in one all-reduce), on several, KV heads
replicated over ranks counted once; clip_qkv, which the engine does not implement, is refused naming it."""

from __future__ import annotations

import pytest
import torch
from transformers import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

from engine.model.layers.context import BuildContext
from engine.model.layers.sharding import Split, TensorParallel
from engine.model.layers.whole_qk_norm import WholeHeadsRMSNorm, norm_q_and_k
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


HEAD_DIM, TOKENS = 8, 5


class _Case:
    """One norm's input and weight over `units` heads, transformers' output, and each rank's share."""

    def __init__(self, units: int, world: int, seed: int):
        self.heads = Split(units, HEAD_DIM, replicate=True)
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(TOKENS, units * HEAD_DIM, generator=gen)
        self.weight = torch.randn(units * HEAD_DIM, generator=gen)
        reference = OlmoeRMSNorm(units * HEAD_DIM, eps=1e-5)
        with torch.no_grad():
            reference.weight.copy_(self.weight)
            self.expected = reference(self.x)
        self.ranges = [self.heads.range(r, world) for r in range(world)]
        # [tokens, 1] per rank; their sum counts replicated heads on each rank that holds them
        self.squares = [self.x[:, s:e].pow(2).sum(-1, keepdim=True) for s, e in self.ranges]

    def local(self, rank: int) -> torch.Tensor:  # [tokens, local heads, head_dim]
        start, end = self.ranges[rank]
        return self.x[:, start:end].reshape(TOKENS, -1, HEAD_DIM)

    def check(self, got: torch.Tensor, rank: int) -> None:
        start, end = self.ranges[rank]
        torch.testing.assert_close(got.reshape(TOKENS, -1), self.expected[:, start:end])


@pytest.mark.parametrize("units, world", [(4, 1), (4, 2), (2, 4)])  # split, and replicated (2 heads, 4 ranks)
def test_norm_over_all_heads_equals_transformers_over_ranks(units, world):
    case = _Case(units, world, seed=0)
    for rank in range(world):
        group = _Summed(sum(case.squares), case.squares[rank]) if world > 1 else None
        norm = norm_on(case.heads, rank, world, case.weight, group)
        case.check(norm(case.local(rank)), rank)


@pytest.mark.parametrize("kv_units, world", [(2, 1), (2, 2), (1, 2), (2, 4)])
def test_q_and_k_norms_share_one_all_reduce(kv_units, world):
    """Attention's path: both sums of squares in one all-reduce ([tokens, 2]), each norm still transformers'."""
    q, k = _Case(4, world, seed=1), _Case(kv_units, world, seed=2)
    for rank in range(world):
        group = None
        if world > 1:
            group = _Summed(
                torch.cat([sum(q.squares), sum(k.squares)], dim=-1),
                torch.cat([q.squares[rank], k.squares[rank]], dim=-1),
            )
        q_norm = norm_on(q.heads, rank, world, q.weight, group)
        k_norm = norm_on(k.heads, rank, world, k.weight, group)
        got_q, got_k = norm_q_and_k(q_norm, k_norm, q.local(rank), k.local(rank))
        q.check(got_q, rank)
        k.check(got_k, rank)


def test_clip_qkv_is_refused_naming_it():
    config = OlmoeConfig(clip_qkv=8.0, architectures=["OlmoeForCausalLM"])
    with pytest.raises(ValueError, match="clip_qkv=8.0"):
        model_class(config).check_config(config)
