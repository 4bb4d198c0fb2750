"""The row-parallel all-reduce fused with the residual add and RMSNorm after it, on CUDA, for small
(decode-sized) inputs: the peers' buffers in torch symmetric memory, the kernel in
engine/parallel/allreduce_norm_kernel.py. Larger inputs (prefills) keep NCCL's all-reduce.

This module is the one place that decides between the two:
- at start-up, `FusedAllReduceNorm.connect` (every rank, same point): `unavailable_reason` (the setting
  `EngineArgs.fused_allreduce`, CUDA, 2 to 8 ranks), then every GPU reaching every other peer to peer and
  the symmetric buffer allocated, voted on by all ranks, so they all take it or none does;
- per call, `FusedAllReduceNorm.fits` (dtype, rows contiguous, hidden size, bytes within the bound), which
  depends only on shapes, the same on every rank.

The bound: a one-shot all-reduce makes each rank read (world - 1) times the input from its peers, while
NCCL's ring moves about 2 (world - 1) / world times it per rank; so the larger the world, the sooner
one-shot loses. `max_bytes` keeps the bytes each rank reads from its peers under PEER_READ_BYTES:
8 MiB of input at tp=2, 2.7 MiB at tp=4 (the 70B shape's decode step at batch 128 is 2 MiB), 1.1 MiB at
tp=8 (benchmarks/fused_allreduce.py measures where the crossover really is).

Multicast (NVLS) is not used: plain peer-to-peer loads only.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from engine.parallel.allreduce_norm_kernel import (
    PeerBuffers,
    allreduce_add_rms_norm,
    fits,
    flag_count,
)

logger = logging.getLogger(__name__)

# The kernel's fixed grid (every program takes part in every call; rows are dealt out round robin).
PROGRAMS = 64
# The most bytes one rank reads from its peers in one call (module docstring).
PEER_READ_BYTES = 8 << 20
WORLD_SIZES = range(2, 9)


def max_bytes(world_size: int) -> int:
    """The largest input (bytes of one rank's partial sums) the fused path takes at this world size."""
    return PEER_READ_BYTES // (world_size - 1) // 256 * 256


def unavailable_reason(enabled: bool, device: torch.device, world_size: int) -> str | None:
    """Why this engine cannot take the fused path, decided from settings alone (so every rank agrees
    without a collective); None: it may, if the GPUs also reach each other (`connect`)."""
    if not enabled:
        return "off (fused_allreduce is False)"
    if device.type != "cuda":
        return f"only on CUDA (this engine runs on {device.type})"
    if world_size not in WORLD_SIZES:
        return f"tensor_parallel_size {world_size} is outside {WORLD_SIZES.start}..{WORLD_SIZES.stop - 1}"
    return None


def unreachable_peers(mine: int, devices: list[int], can_access) -> list[int]:
    """The GPUs of `devices` that GPU `mine` cannot read peer to peer (`can_access(a, b)`)."""
    return [d for d in devices if d != mine and not can_access(mine, d)]


class FusedAllReduceNorm:
    """This rank's symmetric buffer (flags, then two halves of data) and the kernel's view of all ranks'."""

    def __init__(self, peers: PeerBuffers, device: torch.device, keep: tuple):
        self.peers = peers
        self.max_bytes = peers.capacity_bytes
        self._keep = keep  # the symmetric buffer and its handle: the peers' mappings live as long
        self._released = False
        cuda = device.type == "cuda"
        self._one = torch.ones(1, dtype=torch.int32, pin_memory=cuda)  # copied to `abort` by release
        self._side = torch.cuda.Stream(device) if cuda else None

    @classmethod
    def connect(cls, group, enabled: bool) -> FusedAllReduceNorm | None:
        """Every rank of `group` (engine.parallel.group.ParallelGroup) calls this at the same point; all get
        a FusedAllReduceNorm or all get None (logged with the reason)."""
        reason = unavailable_reason(enabled, group.device, group.world_size)
        if reason is not None:
            if enabled:
                logger.info("fused all-reduce + RMSNorm not used: %s", reason)
            return None
        device, world = group.device, group.world_size
        # The same grid on every rank (the flags' layout depends on it), within the smallest GPU's SMs so
        # that all programs are resident at once (each waits on the same program of every peer).
        programs = group.min(min(PROGRAMS, torch.cuda.get_device_properties(device).multi_processor_count))
        flag_bytes = -(-flag_count(programs, world) * 4 // 256) * 256
        capacity = max_bytes(world)
        indices = group.gather_columns(torch.tensor([[device.index]], device=device))[0].tolist()
        unreachable = unreachable_peers(device.index, indices, torch.cuda.can_device_access_peer)
        buffer, error = None, ""
        if unreachable:
            error = f"GPU {device.index} cannot reach GPUs {unreachable} peer to peer"
        else:
            try:
                buffer = _symmetric_empty(flag_bytes + 2 * capacity, device, group.group.group_name)
                buffer.zero_()  # the flags start at 0 (no epoch yet) before any peer can signal
            except Exception as exc:  # no driver support for symmetric memory, say
                error = f"symmetric memory unavailable: {type(exc).__name__}: {exc}"
        if group.min(int(buffer is not None)) == 0:
            logger.warning(
                "fused all-reduce + RMSNorm not used: %s", error or "another rank could not set it up"
            )
            return None
        try:
            handle = _rendezvous(buffer, group.group.group_name)
            # The handle's base addresses (each rank's view of each rank's allocation), plus where our
            # tensor starts in its allocation, which must be the same on every rank (voted on below).
            delta = buffer.data_ptr() - handle.buffer_ptrs[group.rank]
        except Exception as exc:  # a rank that fails here still votes, so none is left waiting
            handle, delta, error = (
                None,
                -1,
                f"symmetric memory rendezvous failed: {type(exc).__name__}: {exc}",
            )
        deltas = group.gather_columns(torch.tensor([[delta]], device=device))[0].tolist()
        if group.min(int(handle is not None and len(set(deltas)) == 1)) == 0:
            logger.warning(
                "fused all-reduce + RMSNorm not used: %s",
                error or f"another rank's rendezvous failed, or buffers at unequal offsets {deltas}",
            )
            return None
        bases = [ptr + delta for ptr in handle.buffer_ptrs]
        peers = PeerBuffers(
            rank=group.rank,
            world_size=world,
            data_ptrs=torch.tensor([b + flag_bytes for b in bases], dtype=torch.int64, device=device),
            flag_ptrs=torch.tensor(bases, dtype=torch.int64, device=device),
            epochs=torch.zeros(programs, dtype=torch.int32, device=device),
            abort=torch.zeros(1, dtype=torch.int32, device=device),
            capacity_bytes=capacity,
            programs=programs,
        )
        group.min(1)  # every rank's flags are zero and mapped before anyone's first call
        logger.info(
            "fused all-reduce + RMSNorm on %d GPUs: inputs up to %d KiB, %d programs",
            world,
            capacity >> 10,
            programs,
        )
        return cls(peers, device, (buffer, handle))

    def fits(self, x: torch.Tensor) -> bool:
        """Whether partial sums `x` ([tokens, hidden]) take the fused path (else NCCL, then the norm)."""
        # Shapes only, never this rank's state, so every rank takes the same path (a released kernel
        # returns at once through the abort flag).
        return x.is_cuda and fits(x, self.max_bytes)

    def __call__(self, partial, residual, weight, eps: float, offset: bool, bias, out=None) -> torch.Tensor:
        """RMSNorm(residual + sum over ranks of `partial` (+ bias)); `residual` updated in place."""
        return allreduce_add_rms_norm(partial, residual, weight, eps, offset, bias, self.peers, out)

    def calls(self) -> int:
        """Calls this rank's kernel made so far (modulo 2**30; reads the GPU: for tests and benchmarks)."""
        return int(self.peers.epochs[0].item())

    def release(self) -> None:
        """A peer died or hangs: end every wait of this rank's kernels now (from any thread), so the GPU is
        not left spinning; the step fails anyway (TensorParallelError). A copy on a side stream: it runs
        beside a kernel that waits."""
        if self._released:
            return
        self._released = True
        if self._side is None:
            self.peers.abort.copy_(self._one)
            return
        try:
            with torch.cuda.stream(self._side):
                self.peers.abort.copy_(self._one, non_blocking=True)
        except Exception as exc:  # a broken CUDA context: nothing of it will run again anyway
            logger.warning("could not release the fused all-reduce's waits: %s", exc)


def _rendezvous(buffer: torch.Tensor, group_name: str):
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.rendezvous(buffer, group_name)


def _symmetric_empty(nbytes: int, device: torch.device, group_name: str) -> torch.Tensor:
    """A byte buffer in torch symmetric memory (peer-to-peer mappable); no multicast object."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # NVLS is off on our hosts; P2P only
    import torch.distributed._symmetric_memory as symm_mem

    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 11):  # later: deprecated, not needed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group_name)
    return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
