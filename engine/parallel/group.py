"""The ranks' process group and the three collectives the sharded model needs.

NCCL on CUDA (the collectives are captured into the decode CUDA graphs like any kernel), gloo on the CPU.
Every collective is bounded by the group's timeout, so a rank that stops answering fails the step with an
error instead of hanging the engine (a rank that dies fails it at once on gloo; NCCL notices within the
timeout).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# The longest any rank waits in one collective. Generous: the ranks reach the first ones after loading
# their shards of the checkpoint in parallel, which may take one rank longer than another.
COLLECTIVE_TIMEOUT_S = 600.0


def free_port() -> int:
    """A free loopback port for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelGroup:
    """This process's rank in the tensor-parallel group (rank 0 schedules; the others are workers)."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    # Rank 0: turns a failed collective into the error that names the worker that died (and stops them).
    on_failure: Callable[[], Exception] | None = None

    @classmethod
    def join(cls, rank: int, world_size: int, port: int, device: torch.device) -> ParallelGroup:
        """Rendezvous with the other ranks on 127.0.0.1:`port` (blocks until all have joined)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            if device.index is None:  # "cuda": the current device, as the rest of the runner reads it
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
        return cls(rank, world_size, device, dist.group.WORLD)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the partial outputs of a row-parallel projection)."""
        self._run(dist.all_reduce, x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:  # [n, cols] -> [n, world_size * cols]
        """Every rank's columns side by side, rank order (the vocabulary shards of the logits)."""
        x = x.contiguous()
        out = x.new_empty(self.world_size * x.shape[0], x.shape[1])
        if self.device.type == "cuda":
            self._run(dist.all_gather_into_tensor, out, x, group=self.group)
        else:  # gloo has no all_gather_into_tensor
            self._run(dist.all_gather, list(out.chunk(self.world_size)), x, group=self.group)
        return (
            out.view(self.world_size, *x.shape)
            .transpose(0, 1)
            .reshape(x.shape[0], self.world_size * x.shape[1])
        )

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (contiguous, same shape everywhere)."""
        self._run(dist.broadcast, x, src=0, group=self.group)
        return x

    def min(self, value: int) -> int:
        """The smallest `value` over the ranks (the KV blocks every rank has room for)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _run(self, collective, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except Exception as exc:
            if self.on_failure is None:
                raise
            raise self.on_failure() from exc

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
