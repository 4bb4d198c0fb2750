"""The fused all-reduce + residual add + RMSNorm kernel on the CPU (TRITON_INTERPRET=1, tests/conftest.py),
with every rank's buffers made up in this one process: each rank's kernel runs in turn, the other ranks'
staged rows and signals written beforehand as their kernels would have (engine/parallel/
allreduce_norm_kernel.py, "The protocol"). Checked against a float64 reference and, bitwise, against the
unfused ops it replaces; the epochs, parities and signals it leaves are checked too."""

from __future__ import annotations

import threading

import pytest
import torch
from fake_peers import CAPACITY, flags_of, make_ranks, stage_and_signal

from engine.model import fused_ops
from engine.parallel.allreduce_norm_kernel import EPOCH_MODULUS, allreduce_add_rms_norm


def reference64(partials, residual, weight, eps, offset, bias):
    x = sum(p.double() for p in partials) + residual.double()
    if bias is not None:
        x = x + bias.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1.0 + weight.double()) if offset else weight.double()), x


def unfused(partials, residual, weight, eps, offset, bias):
    """The ops the kernel replaces (sum rounded once, as a float32-accumulating all-reduce gives it)."""
    x = sum(p.float() for p in partials).to(partials[0].dtype)
    if bias is not None:
        x = x + bias
    residual = residual.clone()
    return fused_ops.rms_norm(x, weight, 1e-6, residual, offset), residual


def run_call(ranks, partials, residual, weight, bias, offset, epoch):
    """One call on every rank (same inputs, same order): outputs and residuals per rank."""
    for rank in range(1, len(ranks)):
        stage_and_signal(ranks, rank, partials[rank], epoch)
    results = []
    for rank, peers in enumerate(ranks):
        mine = residual.clone()
        out = allreduce_add_rms_norm(partials[rank], mine, weight, 1e-6, offset, bias, peers)
        results.append((out, mine))
    return results


@pytest.mark.parametrize(
    "world, programs, tokens, hidden, dtype, offset, with_bias",
    [
        (2, 4, 3, 64, torch.float32, False, False),  # fewer rows than programs: idle programs
        (2, 4, 9, 48, torch.float32, True, True),  # rows over programs; hidden not a power of 2
        (4, 3, 7, 32, torch.float32, False, True),
        (4, 2, 5, 64, torch.bfloat16, False, False),
        (3, 2, 4, 40, torch.float16, True, False),
    ],
)
def test_every_rank_gets_the_reference_twice_back_to_back(
    world, programs, tokens, hidden, dtype, offset, with_bias
):
    torch.manual_seed(world * 100 + tokens)
    ranks = make_ranks(world, programs)
    weight = (torch.rand(hidden) * 0.5 + 0.75).to(dtype)
    bias = torch.randn(hidden).to(dtype) if with_bias else None
    for epoch in (1, 2):  # parity 1, then 0: both halves and both flag sets
        partials = [torch.randn(tokens, hidden).to(dtype) for _ in range(world)]
        residual = torch.randn(tokens, hidden).to(dtype)
        want, want_residual = reference64(partials, residual, weight, 1e-6, offset, bias)
        exact, exact_residual = unfused(partials, residual, weight, 1e-6, offset, bias)
        tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
        for out, mine in run_call(ranks, partials, residual, weight, bias, offset, epoch):
            torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
            torch.testing.assert_close(mine.double(), want_residual, rtol=tol, atol=tol)
            if dtype != torch.bfloat16:  # the interpreter truncates float32 -> bfloat16 (the GPU rounds)
                assert torch.equal(out, exact) and torch.equal(mine, exact_residual)  # the unfused ops
        for peers in ranks:
            assert peers.epochs.tolist() == [epoch] * programs  # every program counted the call
            for sender in range(world):  # every rank signalled every other, in this epoch's parity
                got = flags_of(peers, peers.rank)[epoch % 2, :, sender]
                assert got.tolist() == [0 if sender == peers.rank else epoch] * programs


def test_epochs_wrap_and_keep_alternating_parity():
    ranks = make_ranks(2, 2)
    for peers in ranks:
        peers.epochs.fill_(EPOCH_MODULUS - 1)  # the next call is epoch 2**30 (even), then epoch 1 (odd)
    weight = torch.ones(16)
    for epoch in (EPOCH_MODULUS, 1):
        partials = [torch.randn(2, 16) for _ in range(2)]
        residual = torch.randn(2, 16)
        exact, _ = unfused(partials, residual, weight, 1e-6, False, None)
        for out, _ in run_call(ranks, partials, residual, weight, None, False, epoch):
            assert torch.equal(out, exact)
        assert ranks[0].epochs.tolist() == [epoch % EPOCH_MODULUS] * 2


def test_a_stale_signal_is_not_taken_for_this_call():
    """Rank 1 signalled call 1 only: rank 0's call 3 (same parity) must wait, until the host's abort."""
    ranks = make_ranks(2, 1)
    weight = torch.ones(8)
    run_call(ranks, [torch.randn(1, 8) for _ in range(2)], torch.randn(1, 8), weight, None, False, 1)
    ranks[0].epochs.fill_(2)  # rank 0 at call 3; rank 1's last signal in parity 1 says epoch 1
    done = threading.Event()

    def call():
        allreduce_add_rms_norm(torch.randn(1, 8), torch.randn(1, 8), weight, 1e-6, False, None, ranks[0])
        done.set()

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    assert not done.wait(1.0)  # still waiting for rank 1's epoch 3
    ranks[0].abort.fill_(1)  # what FusedAllReduceNorm.release does when a peer died
    assert done.wait(30.0)
    assert flags_of(ranks[0], 1)[1, 0, 0].item() == 3  # it had signalled its own epoch to rank 1


def test_inputs_it_cannot_take_are_refused():
    ranks = make_ranks(2, 1)
    weight = torch.ones(8)
    too_big = torch.zeros(CAPACITY // 4 + 1, 1)  # float32: one element over a half
    with pytest.raises(ValueError, match="do not fit"):
        allreduce_add_rms_norm(too_big, too_big.clone(), weight[:1], 1e-6, False, None, ranks[0])
    with pytest.raises(ValueError, match="do not fit"):
        x = torch.zeros(2, 8, dtype=torch.float64)
        allreduce_add_rms_norm(x, x.clone(), weight, 1e-6, False, None, ranks[0])
    empty = torch.zeros(0, 8)
    assert allreduce_add_rms_norm(empty, empty.clone(), weight, 1e-6, False, None, ranks[0]).shape == (0, 8)
    assert ranks[0].epochs.tolist() == [0]  # nothing launched, nothing counted


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.parallel.allreduce_norm_kernel import _allreduce_add_norm_kernel

pointers = ["partial_ptr", "residual_ptr", "weight_ptr", "bias_ptr", "out_ptr"]
sig = {name: "*bf16" for name in pointers}
sig.update(data_ptrs="*i64", flag_ptrs="*i64", epochs_ptr="*i32", abort_ptr="*i32")
sig.update({n: "i32" for n in ("num_rows", "programs", "stride_p", "stride_r", "capacity")}, eps="fp32")
constexprs = dict(RANK=1, WORLD=2, HIDDEN=8192, BLOCK=8192, HAS_BIAS=True, OFFSET=False)
sig.update({name: "constexpr" for name in constexprs})
kernel = triton.compile(
    ASTSource(fn=_allreduce_add_norm_kernel, signature=sig, constexprs=constexprs),
    target=GPUTarget("cuda", 90, 32),
    options={"num_warps": 8},
)
print(kernel.asm["ptx"])
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_sm90_with_system_scope_signals():
    """What the interpreter cannot check: Triton lowers the kernel for an H100 (ptxas included), the signal
    is a release at system scope after a CTA barrier, the wait an acquire load at system scope, and peer
    rows load 16 bytes at a time."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ptx = result.stdout
    assert "atom.global.sys.release.exch.b32" in ptx
    assert "ld.global.sys.acquire.b32" in ptx
    assert "ld.global.v4" in ptx
