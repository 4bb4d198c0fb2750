"""Rank 0's side of the worker processes: start them, send each step's header, watch them, stop them.

One spawned process per rank 1..N-1 (spawn, never fork: the engine process holds CUDA state and
threads). Each sends `Hello` once its imports are done, then joins the process group; a worker that
fails says why (`Failed`) and exits. Every wait is bounded:

- start-up by STARTUP_TIMEOUT_S;
- a step by the watchdog thread: a worker that dies (its process sentinel fires), or a step that runs
  longer than STEP_TIMEOUT_S (a worker hung inside a collective), makes the watchdog record why, kill
  every worker (none can run a step alone) and call `on_death` (rank 0 aborts its NCCL communicator
  there, so its own kernels waiting on the lost peer return). The engine thread then raises
  TensorParallelError naming the worker and the reason (TensorParallelRank.check);
- a dead worker's pipe fails the next send at once;
- stopping: Stop, a grace period, then SIGTERM, then SIGKILL. The runner stops the workers when it shuts
  down, when it is garbage-collected, or when the interpreter exits; the workers exit by themselves
  when rank 0's process is gone (engine/parallel/worker.py).
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
# The longest one engine step may take before the workers are taken for hung (vLLM's
# VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS plays this part). Far above any real step (a long prefill of a 70B
# model takes about a second); below the process group's own timeout, so this watchdog acts first.
STEP_TIMEOUT_S = float(os.environ.get("LORASERVE_TP_STEP_TIMEOUT_S", "300"))
# How often the watchdog looks at the clock of the running step.
WATCH_INTERVAL_S = 0.5


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, failed or hung: the engine cannot run another step."""


class Workers:
    def __init__(self, config, model_path: str, max_model_len: int, port: int):
        from engine.parallel.worker import worker_main

        context = multiprocessing.get_context("spawn")
        world_size = config.tensor_parallel_size
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._watchdog = _Watchdog(self.processes)
        self._quiet_read, quiet_write = os.pipe()  # written when stopping: the watchdog then leaves
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, quiet_write)
        for rank in range(1, world_size):
            conn, child_end = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(rank, world_size, port, config, model_path, max_model_len, child_end, os.getpid()),
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
            target=self._watchdog.run, args=(self._quiet_read,), name="tp-watchdog", daemon=True
        ).start()

    @property
    def on_death(self) -> list[Callable[[], None]]:
        """Called on the watchdog thread once a failure killed the workers (TensorParallelRank adds the
        NCCL abort)."""
        return self._watchdog.on_death

    @property
    def failed_reason(self) -> str | None:
        """Why the workers were lost, as the watchdog saw it (None while they are fine)."""
        return self._watchdog.failed_reason

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

    # -- steps --------------------------------------------------------------------------------------

    def send(self, messages: list[bytes]) -> None:
        """One encoded message per worker (rank order); a worker that died fails the step at once."""
        for rank, (conn, message) in enumerate(zip(self.conns, messages), start=1):
            try:
                conn.send_bytes(message)
            except OSError:
                raise self.failure(rank, _receive(conn)) from None

    def begin_step(self) -> None:
        """The engine thread starts a step (it may block in collectives until `end_step`)."""
        self._watchdog.step_started = time.monotonic()

    def end_step(self) -> None:
        self._watchdog.step_started = None

    # -- failures -----------------------------------------------------------------------------------

    def failure(self, rank: int | None = None, message: object = None) -> TensorParallelError:
        """An error naming the worker that failed (`rank`, else the one the watchdog lost, else the first
        found dead or reporting) and its reason. The workers are lost for good: killed, rank 0's
        communicator aborted (the watchdog's reaction, if it has not run yet), and stopped."""
        watched = self._watchdog
        if rank is None:
            rank = watched.failed_rank if watched.failed_reason is not None else self._first_failed()
        if message is None and rank is not None:
            message = _receive(self.conns[rank - 1])
        if isinstance(message, Failed):
            reason = f"tensor-parallel worker {rank} failed ({message.message})"
        elif watched.failed_reason is not None:
            reason = watched.failed_reason
        elif rank is not None:
            self.processes[rank - 1].join(1.0)  # reaped, so its exit code is known
            reason = f"tensor-parallel worker {rank} failed (exit code {self.processes[rank - 1].exitcode})"
        else:
            reason = "a tensor-parallel collective failed"
        watched.lose(reason, rank)
        self.stop()
        return TensorParallelError(f"{reason}; the engine stopped")

    def _first_failed(self) -> int | None:
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            if not process.is_alive() or conn.poll():
                return rank
        return None

    def stop(self) -> None:
        self._finalizer()


class _Watchdog:
    """The watchdog thread's state (apart from Workers, so that the thread keeps no Workers alive)."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess]):
        self.processes = processes
        self.on_death: list[Callable[[], None]] = []
        self.failed_reason: str | None = None
        self.failed_rank: int | None = None  # the worker that died (None for a hang)
        self.step_timeout_s = STEP_TIMEOUT_S
        self.step_started: float | None = None  # monotonic time the running step began; None: idle
        self._lock = threading.Lock()

    def run(self, quiet: int) -> None:
        """Wait for a worker to die, a step to overrun, or `quiet` (the workers are being stopped)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        try:
            while True:
                ready = wait_for([quiet, *sentinels], timeout=WATCH_INTERVAL_S)
                if quiet in ready:
                    return
                if ready:
                    rank = sentinels[ready[0]]
                    process = self.processes[rank - 1]
                    process.join(STOP_GRACE_S)  # its exit code (another thread may be reaping it)
                    self.lose(f"tensor-parallel worker {rank} failed (exit code {process.exitcode})", rank)
                    return
                started = self.step_started
                if started is not None and time.monotonic() - started > self.step_timeout_s:
                    self.lose(
                        f"a tensor-parallel step did not finish within {self.step_timeout_s:.0f} s "
                        "(a worker hung in a collective); the workers were killed",
                        None,
                    )
                    return
        finally:
            os.close(quiet)

    def lose(self, reason: str, rank: int | None) -> None:
        """The workers are lost (the first call says why; later ones change nothing): kill them all (a
        worker blocked in a collective never returns to read Stop), then let rank 0 abort its side."""
        with self._lock:
            if self.failed_reason is not None:
                return
            self.failed_rank, self.failed_reason = rank, reason
        # Outside the lock: the engine thread's `failure` reports at once, never waiting on the NCCL abort
        # (measured on H200s: an abort while rank 0 is blocked in a collective can take over 10 s).
        self._kill_and_abort()

    def _kill_and_abort(self) -> None:
        logger.error("%s: the engine cannot run another step", self.failed_reason)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(STOP_GRACE_S)
        for callback in self.on_death:
            try:
                callback()
            except Exception:
                logger.exception("reacting to lost tensor-parallel workers failed")


def _receive(conn: Connection) -> object:
    """The worker's message if one is there (Failed, usually), else None (it died without a word)."""
    try:
        if conn.poll(0.5):
            return decode_from_worker(conn.recv_bytes())
    except (EOFError, OSError, ValueError):
        pass
    return None


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
