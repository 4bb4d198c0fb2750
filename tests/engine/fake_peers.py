"""Every rank's buffers of the fused all-reduce kernel (engine/parallel/allreduce_norm_kernel.py) made up
in one process on the CPU, and what another rank's kernel does before it waits, so that one rank's kernel
runs under TRITON_INTERPRET=1 as if its peers ran beside it."""

from __future__ import annotations

import torch

from engine.parallel.allreduce_norm_kernel import PeerBuffers, flag_count

CAPACITY = 1 << 14  # bytes per half of a rank's data


def make_ranks(world: int, programs: int) -> list[PeerBuffers]:
    # Poisoned staging (0xFF bytes: NaN in every float dtype), so a row read before it was staged shows.
    data = [torch.full((2 * CAPACITY,), 255, dtype=torch.uint8) for _ in range(world)]
    flags = [torch.zeros(flag_count(programs, world), dtype=torch.int32) for _ in range(world)]
    data_ptrs = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    return [
        PeerBuffers(
            rank,
            world,
            data_ptrs,
            flag_ptrs,
            torch.zeros(programs, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            CAPACITY,
            programs,
            keepalive=(data, flags),
        )
        for rank in range(world)
    ]


def data_of(peers: PeerBuffers, rank: int) -> torch.Tensor:
    return peers.keepalive[0][rank]


def flags_of(peers: PeerBuffers, rank: int) -> torch.Tensor:  # [2, programs, world]
    return peers.keepalive[1][rank].view(2, peers.programs, peers.world_size)


def stage_and_signal(ranks: list[PeerBuffers], rank: int, partial: torch.Tensor, epoch: int) -> None:
    """What rank `rank`'s kernel does before it waits: its rows into its data[parity], its epoch into
    every peer's flags[parity, :, rank]."""
    peers, parity = ranks[rank], epoch % 2
    half = data_of(peers, rank)[parity * CAPACITY : (parity + 1) * CAPACITY].view(partial.dtype)
    half[: partial.numel()] = partial.reshape(-1)
    for other in range(peers.world_size):
        if other != rank:
            flags_of(peers, other)[parity, :, rank] = epoch
