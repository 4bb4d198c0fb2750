"""One kernel for a row-parallel projection's all-reduce and the residual add + RMSNorm after it: each rank
reads every rank's partial sums over peer-to-peer memory (a one-shot all-reduce, as vLLM's custom
all-reduce and FlashInfer's allreduce fusion do for small inputs), adds them in rank order, adds the
bias and the residual, stores the new residual and writes the normalised rows.

The peers are given explicitly (`PeerBuffers`: device arrays of every rank's buffer addresses), so the
kernel runs as well on buffers one process made up, e.g. on the CPU under TRITON_INTERPRET=1 with the
other ranks' partial sums and signals written beforehand (tests/engine/test_fused_allreduce.py); on
GPUs the buffers are torch symmetric memory (engine/parallel/fused_allreduce.py).

Per rank, in memory every peer can reach: `data`, two halves of `capacity_bytes` (a call's partial sums,
[tokens, hidden] contiguous), and `flags`, int32 [2, programs, world]. Local only: `epochs`, int32
[programs], and `abort`, int32 [1].

The protocol (per program p of the fixed grid of `programs`, the same on every rank):
1. epoch = this program's call count + 1 (kept modulo 2**30, an even number, so epochs alternate odd and
   even for ever); parity = epoch % 2 picks the half of `data` and of `flags` this call uses.
2. Stage: copy this rank's rows p, p + programs, ... of the partial sums into data[parity].
3. Signal: after a CTA barrier (every thread's stores done), a release store of `epoch` into each peer's
   flags[parity, p, my rank] (system scope: visible over NVLink with the data before it).
4. Wait: spin on an acquire load of my flags[parity, p, peer] until it holds `epoch`, for every peer,
   then a CTA barrier; the peers' rows staged in step 2 are now visible.
5. Reduce: for the same rows, sum data[parity] of ranks 0..world-1 in float32 in rank order (every rank
   adds the same numbers in the same order, so the residual stays bitwise equal on all ranks), round to
   the model dtype as the all-reduce's output would be (exactly so at two ranks; at more, NCCL's ring
   rounds partial sums at each hop where this sums in float32 once), add the bias and the residual as
   torch does, store the residual, normalise.
Why one barrier suffices back to back: a rank is at most one call ahead of any peer for each program.
Rank A starts call j + 2 only after its call j + 1 ended, which needed every peer's signal of j + 1 in
every program; a peer signals j + 1 only from inside its call j + 1 kernel, so its call j kernel (the
last reader of data[j % 2]) had ended. So A's stage of call j + 2 never overwrites rows a peer still
reads, and A's signal of j + 1 lands in the other parity's slot than the one a peer still waits on for
j. The grid is fixed (idle programs only signal and wait) so that every program counts every call and
the parity is the same for the whole call. Everything lives in device memory and nothing is read back
to the host, so a CUDA graph replays it like any kernel.
`abort` (set by the host when a peer died, `FusedAllReduceNorm.release`) ends every wait: the kernel
returns, its results garbage, and the step that ran it fails with TensorParallelError anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.model.fused_ops import add_rounded, rms_norm_row

# Epochs count calls modulo this (even: the parity alternates across the wrap; < 2**31: int32).
EPOCH_MODULUS = 1 << 30
_EPOCH_MODULUS = tl.constexpr(EPOCH_MODULUS)  # the kernel's copy (Triton reads only constexpr globals)
# Hidden sizes one program normalises a row of (the whole row in registers, as the norm kernel does).
MAX_HIDDEN = 16384


@dataclass(frozen=True)
class PeerBuffers:
    """Where this rank's kernel finds every rank's buffers (see the module docstring for the layout)."""

    rank: int
    world_size: int
    data_ptrs: torch.Tensor  # [world] int64 on the kernel's device: each rank's data (two halves)
    flag_ptrs: torch.Tensor  # [world] int64: each rank's flags, int32 [2, programs, world]
    epochs: torch.Tensor  # [programs] int32: this rank's call count per program (starts at 0)
    abort: torch.Tensor  # [1] int32: nonzero ends every wait
    capacity_bytes: int  # bytes of one half of `data`
    programs: int
    keepalive: tuple = ()  # the tensors the addresses point into, where this object owns them


def flag_count(programs: int, world_size: int) -> int:
    """int32 flags a rank needs: one per parity, program and sending rank."""
    return 2 * programs * world_size


def fits(x: torch.Tensor, capacity_bytes: int) -> bool:
    """Whether the kernel takes partial sums `x` ([tokens, hidden]) into halves of `capacity_bytes`."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(1) == 1
        and x.shape[1] <= MAX_HIDDEN
        and x.numel() * x.element_size() <= capacity_bytes
    )


@triton.jit(do_not_specialize=["num_rows"])
def _allreduce_add_norm_kernel(
    partial_ptr,  # [rows, HIDDEN], row stride stride_p: this rank's partial sums
    residual_ptr,  # [rows, HIDDEN], row stride stride_r: becomes residual + sum (+ bias), in place
    weight_ptr,  # [HIDDEN]
    bias_ptr,  # [HIDDEN] (read if HAS_BIAS)
    out_ptr,  # [rows, HIDDEN], contiguous: the normalised rows
    data_ptrs,  # [WORLD] int64
    flag_ptrs,  # [WORLD] int64
    epochs_ptr,  # [programs] int32
    abort_ptr,  # [1] int32
    num_rows,
    programs,  # the grid's size
    stride_p,
    stride_r,
    capacity,  # elements of one half of a rank's data
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = partial_ptr.dtype.element_ty
    # 1. This call's epoch and parity.
    epoch = tl.load(epochs_ptr + pid) + 1
    tl.store(epochs_ptr + pid, epoch % _EPOCH_MODULUS)
    parity = epoch % 2
    # 2. Stage this rank's rows.
    # (the halves start 256-byte aligned: the hint lets Triton load 16 bytes at a time)
    own = tl.multiple_of(tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype)) + parity * capacity, 16)
    row = pid
    while row < num_rows:  # rows pid, pid + programs, ... (a while: the interpreter's range takes no tensors)
        x = tl.load(partial_ptr + row * stride_p + cols, mask=mask, other=0.0)
        tl.store(own + row * HIDDEN + cols, x, mask=mask)
        row += programs
    # 3. Signal every peer (after every thread's stores).
    tl.debug_barrier()
    slot = (parity * programs + pid) * WORLD
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + slot + RANK, epoch, sem="release", scope="sys")
    # 4. Wait for every peer's signal of this epoch (or the host's abort).
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while (tl.atomic_add(own_flags + slot + peer, 0, sem="acquire", scope="sys") != epoch) & (
                tl.load(abort_ptr, volatile=True) == 0
            ):
                pass
    tl.debug_barrier()
    # 5. Sum in rank order, then bias, residual and the norm, rounded where the unfused ops round.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=mask, other=0.0)
    row = pid
    while row < num_rows:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for src in tl.static_range(WORLD):
            data = tl.multiple_of(tl.load(data_ptrs + src).to(tl.pointer_type(dtype)) + parity * capacity, 16)
            acc += tl.load(data + row * HIDDEN + cols, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(dtype)  # the all-reduce's output
        if HAS_BIAS:
            x = add_rounded(bias, x)
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = add_rounded(x, r)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        out = rms_norm_row(x, weight_ptr, cols, mask, eps, HIDDEN, OFFSET, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * HIDDEN + cols, out, mask=mask)
        row += programs


def allreduce_add_rms_norm(
    partial: torch.Tensor,  # [tokens, hidden]: this rank's partial sums (read only)
    residual: torch.Tensor,  # [tokens, hidden]: becomes residual + sum over ranks (+ bias), in place
    weight: torch.Tensor,  # [hidden]
    eps: float,
    offset: bool,  # Gemma's (1 + weight)
    bias: torch.Tensor | None,  # [hidden]: the projection's bias, added after the sum
    peers: PeerBuffers,
    out: torch.Tensor | None = None,  # [tokens, hidden] contiguous, to write into (else a new tensor)
) -> torch.Tensor:  # [tokens, hidden]: RMSNorm(residual + sum (+ bias))
    """What `all_reduce(partial)` (+ bias), then `fused_ops.rms_norm(x, weight, eps, residual, offset)`
    compute, in one launch. Every rank must call it with the same shapes in the same order."""
    tokens, hidden = partial.shape
    if not fits(partial, peers.capacity_bytes) or residual.shape != partial.shape or residual.stride(1) != 1:
        raise ValueError(
            f"fused all-reduce: partial sums {tuple(partial.shape)} {partial.dtype} (residual "
            f"{tuple(residual.shape)}) do not fit its buffers of {peers.capacity_bytes} bytes"
        )
    dtype = partial.dtype if offset else torch.result_type(weight, partial)
    if out is None:
        out = torch.empty((tokens, hidden), dtype=dtype, device=partial.device)
    elif out.shape != partial.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"fused all-reduce: `out` must be contiguous {tuple(partial.shape)} {dtype}")
    if not tokens:
        return out  # every rank skips it alike: no program counts this call
    block = triton.next_power_of_2(hidden)
    _allreduce_add_norm_kernel[(peers.programs,)](
        partial,
        residual,
        weight,
        bias if bias is not None else weight,
        out,
        peers.data_ptrs,
        peers.flag_ptrs,
        peers.epochs,
        peers.abort,
        tokens,
        peers.programs,
        partial.stride(0),
        residual.stride(0),
        peers.capacity_bytes // partial.element_size(),
        eps,
        RANK=peers.rank,
        WORLD=peers.world_size,
        HIDDEN=hidden,
        BLOCK=block,
        HAS_BIAS=bias is not None,
        OFFSET=offset,
        num_warps=8 if block >= 4096 else 4,
    )
    return out
