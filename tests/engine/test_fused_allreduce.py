"""Where the fused all-reduce + RMSNorm is taken (engine/parallel/fused_allreduce.py) and how the layers hand
it their partial sums (PartialSums, TensorParallel.reduce_add_norm), on the CPU: the decision from the
settings and the GPUs, the size bound, the fallback doing exactly the unfused ops, and the fused call
(the real kernel over made-up peers, tests/engine/fake_peers.py) giving the same numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from fake_peers import make_ranks, stage_and_signal

from engine.config import EngineConfig
from engine.engine_args import EngineArgs
from engine.model import fused_ops
from engine.model.layers.context import BuildContext
from engine.model.layers.norm import RMSNorm
from engine.model.layers.sharding import PartialSums, TensorParallel
from engine.parallel.allreduce_norm_kernel import allreduce_add_rms_norm, fits
from engine.parallel.fused_allreduce import (
    FusedAllReduceNorm,
    max_bytes,
    unavailable_reason,
    unreachable_peers,
)

CUDA = torch.device("cuda", 0)


def test_the_setting_is_off_by_default_and_a_flag():
    assert EngineArgs().fused_allreduce is False
    assert EngineConfig(model="m", fused_allreduce=True).fused_allreduce is True


@pytest.mark.parametrize(
    "enabled, device, world, reason",
    [
        (False, CUDA, 2, "off"),
        (True, torch.device("cpu"), 2, "only on CUDA"),
        (True, CUDA, 1, "outside 2..8"),
        (True, CUDA, 9, "outside 2..8"),
        (True, CUDA, 2, None),
        (True, CUDA, 8, None),
    ],
)
def test_what_the_settings_alone_decide(enabled, device, world, reason):
    got = unavailable_reason(enabled, device, world)
    assert got is None if reason is None else reason in got


def test_a_gpu_without_peer_access_to_another_is_found():
    reach = {(0, 1), (1, 0), (0, 2), (2, 0)}  # 1 and 2 do not reach each other
    can = lambda a, b: (a, b) in reach  # noqa: E731
    assert unreachable_peers(0, [0, 1, 2], can) == []
    assert unreachable_peers(1, [0, 1, 2], can) == [2]


def test_the_size_bound_shrinks_with_the_world_and_takes_a_70b_decode_step_at_tp4():
    bounds = [max_bytes(w) for w in range(2, 9)]
    assert bounds == sorted(bounds, reverse=True) and bounds[0] == 8 << 20
    assert max_bytes(4) >= 128 * 8192 * 2  # batch 128 x hidden 8192, bf16
    assert max_bytes(8) < 128 * 8192 * 2


def test_inputs_the_kernel_takes():
    cap = 1 << 12
    assert fits(torch.zeros(8, 64, dtype=torch.bfloat16), cap)
    assert fits(torch.zeros(32, 32), cap) and not fits(torch.zeros(32, 33), cap)  # bytes
    assert not fits(torch.zeros(8, 64, dtype=torch.float64), cap)  # dtype
    assert not fits(torch.zeros(64, 8).t(), cap)  # rows not contiguous
    assert not fits(torch.zeros(1, 32768, dtype=torch.float16), 1 << 20)  # hidden over MAX_HIDDEN
    assert not fits(torch.zeros(2, 4, 4), cap)


class NoCollectives:
    """A group that must not be asked anything: settings alone say no."""

    device = torch.device("cpu")
    world_size = 2

    def __getattr__(self, name):
        raise AssertionError(f"no collective may run when the settings rule the fused path out ({name})")


def test_connect_decides_without_a_collective_when_the_settings_say_no():
    assert FusedAllReduceNorm.connect(NoCollectives(), enabled=True) is None
    assert FusedAllReduceNorm.connect(NoCollectives(), enabled=False) is None


class InProcessFused:
    """FusedAllReduceNorm's interface over made-up peers: rank 0 of two whose twin holds the same partial
    sums (so the sum is 2x, what TwinGroup.all_reduce gives), on the interpreted kernel."""

    def __init__(self, max_bytes: int):
        self.ranks, self.max_bytes, self.calls, self.epoch = make_ranks(2, 2), max_bytes, 0, 0

    def fits(self, x):
        return fits(x, self.max_bytes)

    def __call__(self, partial, residual, weight, eps, offset, bias):
        self.calls += 1
        self.epoch += 1
        stage_and_signal(self.ranks, 1, partial, self.epoch)
        return allreduce_add_rms_norm(partial, residual, weight, eps, offset, bias, self.ranks[0])


@dataclass
class TwinGroup:
    fused_add_norm: InProcessFused | None
    reduced: list = field(default_factory=list)
    group = None

    def all_reduce(self, x):
        self.reduced.append(tuple(x.shape))
        return x.mul_(2)

    def gather_columns(self, x):
        raise AssertionError("not used")


@pytest.mark.parametrize("offset, with_bias", [(False, False), (True, True)])
def test_the_fused_call_and_the_nccl_fallback_give_the_unfused_ops_results(offset, with_bias):
    torch.manual_seed(3)
    hidden = 32
    ctx = BuildContext(torch.float32, torch.device("cpu"), fused=True)
    norm = RMSNorm(hidden, 1e-6, ctx, offset)
    norm.weight.data.copy_(torch.rand(hidden) + 0.5)
    bias = torch.randn(hidden) if with_bias else None
    fused = InProcessFused(max_bytes=4 * hidden * 4)  # takes up to 4 rows of float32
    group = TwinGroup(fused)
    tp = TensorParallel(0, 2, group)
    assert tp.fuses_add_norm
    for tokens, takes_fused in ((3, True), (4, True), (5, False)):  # the bound: NCCL past 4 rows
        partial, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        x = partial * 2 if bias is None else partial * 2 + bias  # today's ops: all-reduce, + bias, norm
        want_residual = residual.clone()
        want = fused_ops.rms_norm(x, norm.weight, 1e-6, want_residual, offset)
        calls, reduced = fused.calls, len(group.reduced)
        mine = residual.clone()
        out, new_residual = norm(PartialSums(partial.clone(), bias, tp), mine)
        assert new_residual is mine  # updated in place, as the fused norm does
        assert torch.equal(out, want) and torch.equal(mine, want_residual)
        assert fused.calls - calls == int(takes_fused)
        assert len(group.reduced) - reduced == int(not takes_fused)


def test_partial_sums_without_a_residual_are_reduced_then_normalised():
    ctx = BuildContext(torch.float32, torch.device("cpu"), fused=True)
    norm = RMSNorm(16, 1e-6, ctx)
    norm.weight.data.fill_(1.0)
    group = TwinGroup(InProcessFused(1 << 12))
    partial = torch.randn(2, 16)
    out = norm(PartialSums(partial.clone(), None, TensorParallel(0, 2, group)))
    assert torch.equal(out, fused_ops.rms_norm(partial * 2, norm.weight, 1e-6))
    assert group.reduced == [(2, 16)]


def test_a_sharded_model_forward_is_the_same_with_its_reductions_fused(tmp_path):
    """Rank 0 of two (its twin holding the same partial sums) through a whole Llama forward on the Triton
    path: without the fused all-reduce every row-parallel layer all-reduces by itself (today's model);
    with it o_proj and down_proj hand their sums to the next norm (post_attention_layernorm, the next
    input_layernorm, the final norm), one fused call each, and the hidden states are bitwise the same."""
    from factories import make_model

    from engine.model.attention import AttentionMetadata
    from engine.model.loader import load_config, load_model

    model_dir = make_model(tmp_path / "m", arch="llama", seed=1)
    config = load_config(model_dir)
    fused = InProcessFused(max_bytes=1 << 14)
    hidden = {}
    for name, group in (("unfused", TwinGroup(None)), ("fused", TwinGroup(fused))):
        tp = TensorParallel(0, 2, group)
        model = load_model(model_dir, config, torch.float32, torch.device("cpu"), 64, "triton", tp=tp)
        projections = [m for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]
        assert projections and all(m.defer_reduce == (name == "fused") for m in projections)
        shape = (4, 4, model.num_kv_heads, model.head_dim)  # 4 blocks of 4 tokens
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
        meta = AttentionMetadata(
            positions=torch.arange(5),
            slot_mapping=torch.arange(5),
            block_tables=torch.tensor([[0, 1]]),
            query_start_loc=[0, 5],
            seq_lens=[5],
        )
        hidden[name] = model.forward(torch.tensor([3, 17, 42, 7, 99]), meta, caches, None)
    assert fused.calls == 2 * config.num_hidden_layers  # after every o_proj and every down_proj
    assert torch.equal(hidden["fused"], hidden["unfused"])


class VotingGroup:
    """Rank 0 of two on a stand-in device: its collectives answer as if the other rank agreed (or not)."""

    def __init__(self, other_votes: int = 1, other_delta: int | None = None):
        self.rank, self.world_size, self.device = 0, 2, torch.device("cpu", 0)
        self.group = SimpleNamespace(group_name="0")
        self.other_votes, self.other_delta, self.votes, self.gathers = other_votes, other_delta, [], 0

    def gather_columns(self, x):  # [[mine]] -> [[mine, other's]]: the GPU indices, then the offsets
        self.gathers += 1
        if self.gathers == 1:
            return torch.cat([x, x + 1], dim=1)  # the other rank is on the next GPU
        other = x if self.other_delta is None else torch.full_like(x, self.other_delta)
        return torch.cat([x, other], dim=1)

    def min(self, value: int) -> int:
        self.votes.append(value)
        return min(value, self.other_votes) if len(self.votes) > 1 else value


@pytest.fixture
def stand_in_gpus(monkeypatch):
    """CUDA's part of FusedAllReduceNorm.connect stood in for: 132 SMs, peer access, a byte buffer and a
    rendezvous whose handle's base addresses are the buffers' minus an offset of 512."""
    from engine.parallel import fused_allreduce

    state = SimpleNamespace(reach=True, rendezvous_error=None, buffers=[])
    monkeypatch.setattr(fused_allreduce, "unavailable_reason", lambda *args: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132)
    )
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: state.reach)

    def empty(nbytes, device, group_name):
        state.buffers.append(torch.full((nbytes,), 7, dtype=torch.uint8))
        return state.buffers[-1]

    def rendezvous(buffer, group_name):
        if state.rendezvous_error:
            raise RuntimeError(state.rendezvous_error)
        return SimpleNamespace(buffer_ptrs=[buffer.data_ptr() - 512, 1 << 40])

    monkeypatch.setattr(fused_allreduce, "_symmetric_empty", empty)
    monkeypatch.setattr(fused_allreduce, "_rendezvous", rendezvous)
    return state


def test_connect_sets_up_every_rank_s_addresses_when_all_agree(stand_in_gpus):
    group = VotingGroup()
    fused = FusedAllReduceNorm.connect(group, enabled=True)
    assert fused is not None and group.votes == [64, 1, 1, 1]  # grid, buffer, rendezvous, ready
    peers = fused.peers
    assert peers.programs == 64 and peers.capacity_bytes == max_bytes(2)
    buffer = stand_in_gpus.buffers[0]
    assert int(buffer.max()) == 0  # zeroed (no epoch yet) before any peer may signal
    flag_bytes = peers.data_ptrs[0].item() - peers.flag_ptrs[0].item()
    assert flag_bytes >= 2 * 64 * 2 * 4 and flag_bytes % 256 == 0
    assert peers.flag_ptrs.tolist() == [buffer.data_ptr(), (1 << 40) + 512]  # each base plus the offset
    assert buffer.numel() == flag_bytes + 2 * peers.capacity_bytes
    assert fused.fits(torch.zeros(4, 64)) is False  # not a CUDA tensor
    fused.release()
    assert peers.abort.item() == 1


@pytest.mark.parametrize(
    "why, setup",
    [
        ("no peer access", dict(reach=False)),
        ("another rank without a buffer", dict(other_votes=0)),
        ("a failed rendezvous", dict(rendezvous_error="no driver support")),
        ("unequal offsets", dict(other_delta=4096)),
    ],
)
def test_connect_falls_back_to_nccl_on_every_rank_together(stand_in_gpus, why, setup):
    stand_in_gpus.reach = setup.get("reach", True)
    stand_in_gpus.rendezvous_error = setup.get("rendezvous_error")
    group = VotingGroup(setup.get("other_votes", 1), setup.get("other_delta"))
    assert FusedAllReduceNorm.connect(group, enabled=True) is None, why
    assert 0 in group.votes or setup.get("other_votes") == 0  # this rank said no, or heard another's no
