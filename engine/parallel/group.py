"""The ranks' process group and the three collectives the sharded model needs, and how rank 0 leaves it.

NCCL on CUDA (the collectives are captured into the decode CUDA graphs like any kernel), gloo on the CPU.
A collective that fails (gloo: a peer died; NCCL: the communicator was aborted) raises the error that
`on_failure` builds, which names the worker at fault (engine/parallel/workers.py).

Leaving the group never waits on the other ranks. NCCL's orderly teardown (`destroy_process_group`,
i.e. ncclCommFinalize + ncclCommDestroy) is an intra-node collective: every rank of the host must call
it, and a rank whose peers already exited waits for them forever (in C++, where no signal reaches it).
So rank 0 *aborts* its communicator once the workers have exited (ncclCommAbort needs only the live
ranks, and none is left), and does it on a helper thread it waits for a bounded time: whatever NCCL
does, `leave` returns within LEAVE_TIMEOUT_S. gloo's teardown is local and is bounded the same way.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The longest any rank waits in one collective. Generous: the ranks reach the first ones after loading
# their shards of the checkpoint in parallel, which may take one rank longer than another.
COLLECTIVE_TIMEOUT_S = 600.0
# The longest rank 0 waits for its communicator's teardown (an abort takes milliseconds).
LEAVE_TIMEOUT_S = 10.0


def free_port() -> int:
    """A free loopback port for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bounded(work: Callable[[], None], timeout_s: float, what: str) -> bool:
    """Run `work` on a daemon thread and wait at most `timeout_s` (the wait, unlike a call stuck in C++,
    gives way to Ctrl-C). False if it did not return in time: it is left running, and logged."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # reported below, on the caller's thread
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=what, daemon=True).start()
    if not done.wait(timeout_s):
        logger.error("%s did not return within %.0f s; left running on a thread of its own", what, timeout_s)
        return False
    if errors:
        logger.warning("%s failed: %s", what, errors[0])
    return True


@dataclass
class ParallelGroup:
    """This process's rank in the tensor-parallel group (rank 0 schedules; the others are workers)."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    # Rank 0: turns a failed collective into the error that names the worker that died (and stops them).
    on_failure: Callable[[], Exception] | None = None
    # False once the group was left or aborted (then nothing of it may be used again).
    joined: bool = True
    # Set when a teardown did not return in time: the process cannot form another group.
    stuck: bool = False
    # The all-reduce fused with the residual add and RMSNorm (engine/parallel/fused_allreduce.py), when
    # `use_fused_add_norm` set it up; the layers ask it per call (TensorParallel.reduce_add_norm).
    fused_add_norm: object | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
            device_id=device if device.type == "cuda" else None,  # NCCL's communicator made now, eagerly
        )
        return cls(rank, world_size, device, dist.group.WORLD)

    def use_fused_add_norm(self, enabled: bool) -> None:
        """Set up the fused all-reduce + RMSNorm if `enabled` and the GPUs allow (every rank calls this at
        the same point, before building its model; all ranks get it or none does)."""
        from engine.parallel.fused_allreduce import FusedAllReduceNorm

        self.fused_add_norm = FusedAllReduceNorm.connect(self, enabled)

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

    def abort(self) -> None:
        """NCCL: abort the communicator now (from any thread): kernels waiting on a dead or hung peer
        return, and later collectives fail. Call it once the other ranks are dead or stopping; a no-op on
        gloo (its collectives fail by themselves when a peer's socket closes) and once left. The fused
        all-reduce's waits end too (its kernels do not listen to NCCL)."""
        if self.fused_add_norm is not None:
            self.fused_add_norm.release()
        if self.device.type == "cuda":
            self._teardown(lambda: dist.distributed_c10d._abort_process_group(self.group), "NCCL abort")

    def leave(self) -> None:
        """Leave the group for good, so that another engine may form one in this process; returns within
        LEAVE_TIMEOUT_S. Rank 0 calls it after its workers exited (see the module docstring)."""
        if self.device.type == "cuda":
            self.abort()
        else:
            self._teardown(lambda: dist.destroy_process_group(self.group), "leaving the gloo group")

    def _teardown(self, work: Callable[[], None], what: str) -> None:
        with self._lock:  # the watchdog thread and the engine thread may both get here
            if not self.joined:
                return
            self.joined = False
            if not dist.is_initialized():
                return
            if not run_bounded(work, LEAVE_TIMEOUT_S, what):
                self.stuck = True
