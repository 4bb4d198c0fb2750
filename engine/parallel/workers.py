"""Rank 0's side of the worker processes: start them, send each step's header, stop them.

One spawned process per rank 1..N-1 (spawn, never fork: the engine process holds CUDA state and
threads). Each sends `Hello` once its imports are done, then joins the process group; a worker that
fails says why (`Failed`) and exits. Every wait is bounded: start-up by `STARTUP_TIMEOUT_S`, a dead
worker's pipe fails the next send at once, and the workers are stopped (terminated, then killed) when the
runner shuts down, when it is garbage-collected, or when the interpreter exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for

from engine.parallel.messages import Failed, Hello, Stop, decode_from_worker, encode

logger = logging.getLogger(__name__)

# A worker imports torch and the engine before its Hello (seconds); a worker that says nothing for this
# long is taken for dead.
STARTUP_TIMEOUT_S = 120.0
# How long a stopping worker gets to leave its loop before it is terminated.
STOP_GRACE_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot run another step."""


class Workers:
    def __init__(self, config, model_path: str, max_model_len: int, port: int):
        from engine.parallel.worker import worker_main

        context = multiprocessing.get_context("spawn")
        world_size = config.tensor_parallel_size
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        # Called on the watchdog thread when a worker dies unasked (TensorParallelRank adds NCCL's abort).
        self.on_death: list[Callable[[], None]] = []
        self._quiet_read, quiet_write = os.pipe()  # written when stopping: the watchdog then leaves
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, quiet_write)
        for rank in range(1, world_size):
            conn, child_end = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(rank, world_size, port, config, model_path, max_model_len, child_end),
                name=f"tp-worker-{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()  # so a dead worker reads as EOF here
            self.processes.append(process)
            self.conns.append(conn)
        try:
            self._wait_for_hello()
        except BaseException:
            self.stop()
            os.close(self._quiet_read)
            raise
        threading.Thread(
            target=_watch,
            args=([p.sentinel for p in self.processes], self._quiet_read, self.on_death),
            name="tp-watchdog",
            daemon=True,
        ).start()

    def _wait_for_hello(self) -> None:
        waiting = dict(zip(self.conns, range(1, len(self.conns) + 1)))
        while waiting:
            ready = wait_for(
                [*waiting, *(self.processes[r - 1].sentinel for r in waiting.values())],
                timeout=STARTUP_TIMEOUT_S,
            )
            if not ready:
                raise TensorParallelError(
                    f"tensor-parallel workers {sorted(waiting.values())} did not start within "
                    f"{STARTUP_TIMEOUT_S:.0f} s"
                )
            for conn in [
                c for c in waiting if c in ready or self.processes[waiting[c] - 1].sentinel in ready
            ]:
                rank = waiting.pop(conn)
                message = _receive(conn)
                if not isinstance(message, Hello):
                    raise self.failure(rank, message)

    def send(self, messages: list[bytes]) -> None:
        """One encoded message per worker (rank order); a worker that died fails the step at once."""
        for rank, (conn, message) in enumerate(zip(self.conns, messages), start=1):
            try:
                conn.send_bytes(message)
            except OSError:
                raise self.failure(rank, _receive(conn)) from None

    def failure(self, rank: int | None = None, message: object = None) -> TensorParallelError:
        """An error naming the worker that failed (the first one found dead or reporting, if `rank` is
        None) and its reason; every worker is stopped, since none can run another step alone."""
        if rank is None:
            for r, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
                if not process.is_alive() or conn.poll():
                    rank, message = r, _receive(conn)
                    break
        self.stop()
        if rank is None:
            return TensorParallelError("a tensor-parallel collective failed; the workers were stopped")
        process = self.processes[rank - 1]
        reason = message.message if isinstance(message, Failed) else f"exit code {process.exitcode}"
        return TensorParallelError(f"tensor-parallel worker {rank} failed ({reason}); the engine stopped")

    def stop(self) -> None:
        self._finalizer()


def _receive(conn: Connection) -> object:
    """The worker's message if one is there (Failed, usually), else None (it died without a word)."""
    try:
        if conn.poll(0.5):
            return decode_from_worker(conn.recv_bytes())
    except (EOFError, OSError, ValueError):
        pass
    return None


def _watch(sentinels: list[int], quiet: int, on_death: list[Callable[[], None]]) -> None:
    """Wait for a worker to die or for `quiet` (the workers are being stopped); on a death, call `on_death`."""
    ready = wait_for([quiet, *sentinels])
    if quiet not in ready:
        logger.error("a tensor-parallel worker died; the engine cannot run another step")
        for callback in on_death:
            try:
                callback()
            except Exception:
                logger.exception("reacting to a dead tensor-parallel worker failed")
    os.close(quiet)


def _stop(processes, conns, quiet: int) -> None:
    """Ask every worker to stop, then terminate and kill whatever is left; close the pipes."""
    try:
        os.write(quiet, b"x")  # first: the watchdog must not take these exits for deaths
    except OSError:  # the watchdog already left (a worker died)
        pass
    os.close(quiet)
    for conn in conns:
        try:
            conn.send_bytes(encode(Stop()))
        except (OSError, ValueError):
            pass
    for signal in (None, "terminate", "kill"):  # each round bounded by one grace period for all
        alive = [p for p in processes if p.is_alive()]
        if signal is not None:
            for process in alive:
                logger.warning("tensor-parallel worker %s did not stop: %s", process.name, signal)
                getattr(process, signal)()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
    for conn in conns:
        conn.close()
