"""Adapter loads in the background: on worker threads, or whole in loader processes.

A load brings one adapter into a row of the CPU tier: `source.load(adapter_id, read)` fetches it (store
manifest, disk cache, download) and calls `read(folder)`, which validates the PEFT folder and lays it out
in the row (`read_into`). The adapter manager starts loads and collects finished ones once per step.

- `ThreadLoads` runs loads on a pool of worker threads: no processes to start, for the CPU device and tests.
- `ProcessLoads` runs the whole load, the source's part included, in spawned loader processes that write
  straight into the tier's shared rows. The engine thread sends each job down an idle loader's pipe and
  polls the pipes for answers when it collects: the serving process runs no thread per load. Every
  Python line a worker thread runs (its wake-ups, the manifest read, the cache checkout, the pipe round
  trip) takes the interpreter's lock from the engine thread and slows the running batch
  (docs/BENCHMARKS.md, adapter loading).

A source that runs in loader processes is pickled with each job, so it must pickle into something that
loads the same adapters there (`StoreAdapterSource` pickles into a recipe that each process builds once;
`AdapterRegistry` into a copy of its folders). What its observer and metrics saw in a loader process
comes back with the answer: the process calls `source.drain()` after each load, and the serving process
hands the result to `source.replay(records)` (both optional).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from adapter_format.checkpoint import map_peft_adapter, peft_adapter_from_memory
from adapter_format.errors import AdapterError
from engine.core.steady import move_to_others
from engine.lora.host_tier import HostTier
from engine.lora.slots import build_image

if TYPE_CHECKING:
    from engine.lora.manager import AdapterSource

logger = logging.getLogger(__name__)

# (adapter id, the exception its load raised, or None)
Finished = tuple[str, Exception | None]

# Where a load found its adapter when the source does not say: a local folder (a registered one).
DEFAULT_ORIGIN = "disk"


class BackgroundLoads(Protocol):
    tier: HostTier
    # adapter id -> where its finished load found it ("disk" or "store"), for each load `finished`
    # returned; the manager pops them (engine/lora/cold_starts.py).
    origins: dict[str, str]

    def start(self, adapter_id: str, row: int) -> None:
        """Begin loading the adapter into row `row` (the caller owns the row until the load finishes)."""

    def finished(self) -> list[Finished]:
        """The loads that ended since the last call; never blocks. Called on the engine thread."""

    def wait(self, timeout: float) -> None:
        """Block until some load may have finished, at most `timeout` seconds."""

    def close(self) -> None:
        """Stop: loads still running may fail or be dropped."""


def read_into(tier: HostTier, row: int, folder: str | Path) -> None:
    """Validate the adapter in `folder` against the model and lay it out in row `row` of the tier, read
    straight from the mapped file (no tensors in between: docs/BENCHMARKS.md, load rate)."""
    served = tier.vocab_rows > 0  # an adapter's own embedding / LM head: refused when no row has room
    adapter = map_peft_adapter(folder, tier.layout.shape, tier.layout.max_rank, vocab_modules_served=served)
    build_image(tier.layout, tier.dtype, adapter, out=tier.image(row))


class RowReader:
    """The `read` a load hands its source: lays the adapter out in one row of the CPU tier.

    A source calls it with a folder (`read(folder)`), or, when it holds the files in memory (a store
    download streamed without a temporary file), `read.from_memory(config, weights)`. It may also say
    where the adapter came from (`read.came_from("store")`), for the cold-start metrics."""

    def __init__(self, tier: HostTier, row: int):
        self.tier, self.row = tier, row
        self.origin = DEFAULT_ORIGIN

    def __call__(self, folder: str | Path) -> None:
        read_into(self.tier, self.row, folder)

    def from_memory(self, config: bytes, weights: bytes | bytearray | memoryview, label: str) -> None:
        """The same checks and layout from a config and a safetensors file held in memory; `label`
        names the weights in errors."""
        layout = self.tier.layout
        served = self.tier.vocab_rows > 0
        adapter = peft_adapter_from_memory(config, weights, layout.shape, layout.max_rank, label, served)
        build_image(layout, self.tier.dtype, adapter, out=self.tier.image(self.row))

    def came_from(self, origin: str) -> None:
        self.origin = origin


class ThreadLoads:
    def __init__(self, source: AdapterSource, tier: HostTier, num_workers: int = 2):
        self.source, self.tier = source, tier
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="adapter-load")
        self._futures: dict[str, tuple[Future, RowReader]] = {}
        self.origins: dict[str, str] = {}

    def start(self, adapter_id: str, row: int) -> None:
        reader = RowReader(self.tier, row)
        self._futures[adapter_id] = self._pool.submit(self.source.load, adapter_id, reader), reader

    def finished(self) -> list[Finished]:
        done = [(adapter_id, job) for adapter_id, job in self._futures.items() if job[0].done()]
        for adapter_id, (_, reader) in done:
            del self._futures[adapter_id]
            self.origins[adapter_id] = reader.origin
        return [(adapter_id, future.exception()) for adapter_id, (future, _) in done]

    def wait(self, timeout: float) -> None:
        if self._futures:
            futures = [future for future, _ in self._futures.values()]
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _serve(conn: Connection, tier: HostTier) -> None:
    """A loader process: runs pickled (source, adapter id, row) jobs from its pipe until it closes,
    answering each with (the exception the load raised, or None; what the source recorded; where the
    load found the adapter)."""
    # One torch thread and a lower priority: a loader's copies are small, and idle OpenMP threads spin,
    # taking cores from the serving process (with torch's default of a thread per core, two loaders
    # slowed the decode steps and their own loads; docs/BENCHMARKS.md, adapter loading).
    torch.set_num_threads(1)
    os.nice(10)
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:  # the serving process closed its end, or exited
            return
        error, records, origin = None, [], DEFAULT_ORIGIN
        try:
            source, adapter_id, row = pickle.loads(job)
            reader = RowReader(tier, row)
            try:
                source.load(adapter_id, reader)
                origin = reader.origin
            finally:
                drain = getattr(source, "drain", None)
                records = drain() if drain is not None else []
        except Exception as exc:  # the load's own failure, for the engine to report
            error = exc
        try:
            conn.send_bytes(pickle.dumps((_picklable(error), records, origin)))
        except OSError:  # closed while this load ran
            return


def _picklable(error: Exception | None) -> Exception | None:
    """The error itself where it pickles (AdapterError keeps its code), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return AdapterError("load_failed", f"{type(error).__name__}: {error}")
    return error


class _Loader:
    """One loader process and the serving process's end of its pipe."""

    def __init__(self, context, tier: HostTier):
        self.conn, child_end = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child_end, tier), name="adapter-loader", daemon=True
        )
        self.process.start()  # returns at once; the process imports in the background
        move_to_others(self.process.pid)  # never on the core loop's own CPU (engine.core.steady)
        child_end.close()  # so a dead process reads as EOF here, not as a load that never ends
        # The jobs sent and not answered yet, in order: the first runs, the others wait in its pipe.
        self.jobs: deque[tuple[str, int]] = deque()

    def stop(self) -> None:
        self.conn.close()  # the process sees EOF and exits once its current load (if any) ends


def default_num_loaders() -> int:
    """Loader processes to run: half the cores this process may use, from 2 to 8. A load is one core's work
    (hash, read, lay out) and a 22 MB one takes tens of milliseconds, so two loaders capped W2 at about 17
    loads/s; more run beside the engine thread at a lower priority (docs/BENCHMARKS.md, adapter loading)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 2
    return max(2, min(8, cores // 2))


class ProcessLoads:
    """Loads in `num_processes` spawned processes (spawned, not forked: the server holds CUDA state and
    threads that a fork would copy half-way), which receive the tier's shared memory once at start.
    They start at once, so the first load does not wait for their imports. Each process is sent up to
    `JOBS_PER_LOADER` jobs, so it starts the next as soon as one ends instead of idling until the engine
    collects its answer at its next step; jobs beyond that queue here and go out as answers come in.
    A process that dies is replaced; the load it ran fails with the reason, and the jobs waiting in its
    pipe go to the others."""

    JOBS_PER_LOADER = 2

    def __init__(self, source: AdapterSource, tier: HostTier, num_processes: int | None = None):
        num_processes = default_num_loaders() if num_processes is None else num_processes
        if not tier.shared:
            raise ValueError("loader processes need a CPU tier in shared memory (HostTier(shared=True))")
        if num_processes < 1:
            raise ValueError(f"num_processes must be positive (got {num_processes})")
        self.source, self.tier = source, tier
        self._context = multiprocessing.get_context("spawn")
        self._loaders = [_Loader(self._context, tier) for _ in range(num_processes)]
        self._queue: deque[tuple[str, int]] = deque()
        self._unsent: list[Finished] = []  # jobs that failed before reaching a process
        self._closed = False
        self.origins: dict[str, str] = {}

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        return [loader.process for loader in self._loaders]

    def start(self, adapter_id: str, row: int) -> None:
        if self._closed:
            self._unsent.append(
                (adapter_id, AdapterError("load_failed", "the adapter loader processes were shut down"))
            )
            return
        self._queue.append((adapter_id, row))
        self._dispatch()

    def finished(self) -> list[Finished]:
        done, self._unsent = self._unsent, []
        for loader in list(self._loaders):
            while loader.jobs and loader.conn.poll():
                try:
                    error, records, origin = pickle.loads(loader.conn.recv_bytes())
                except (EOFError, OSError):  # the process died (killed, out of memory)
                    done.append(self._lost(loader))
                else:
                    adapter_id, _ = loader.jobs.popleft()
                    self._replay(records)
                    self.origins[adapter_id] = origin
                    done.append((adapter_id, error))
        self._dispatch()
        return done

    def wait(self, timeout: float) -> None:
        busy = [loader.conn for loader in self._loaders if loader.jobs]
        if busy:
            wait_for_connections(busy, timeout)

    def close(self) -> None:
        self._closed = True
        self._queue.clear()
        for loader in self._loaders:
            loader.stop()

    def _dispatch(self) -> None:
        while self._queue:
            loader = min(self._loaders, key=lambda loader: len(loader.jobs))  # the least busy first
            if len(loader.jobs) >= self.JOBS_PER_LOADER:
                return
            adapter_id, row = self._queue.popleft()
            try:
                job = pickle.dumps((self.source, adapter_id, row))
            except Exception as exc:
                self._unsent.append(
                    (
                        adapter_id,
                        AdapterError(
                            "load_failed", f"{self.source!r} cannot be sent to a loader process: {exc}"
                        ),
                    )
                )
                continue
            try:
                loader.conn.send_bytes(job)
            except OSError:  # died: its running load fails, the others go to the new one
                self._queue.appendleft((adapter_id, row))
                if loader.jobs:
                    self._unsent.append(self._lost(loader))
                else:
                    self._replace(loader)
                continue
            loader.jobs.append((adapter_id, row))

    def _replay(self, records: list[Any]) -> None:
        replay = getattr(self.source, "replay", None)
        if records and replay is not None:
            try:
                replay(records)
            except Exception:  # metrics must never stop serving
                logger.exception("replaying a loader process's records failed")

    def _lost(self, dead: _Loader) -> Finished:
        """A process died: the load it ran fails, the jobs waiting in its pipe (never started) are queued
        again, and a new process replaces it."""
        adapter_id, _ = dead.jobs.popleft()
        self._queue.extendleft(reversed(dead.jobs))
        dead.jobs.clear()
        self._replace(dead)
        error = AdapterError(
            "load_failed",
            f"the adapter loader process died while loading {adapter_id!r} (out of memory?); "
            "the next request retries",
        )
        return adapter_id, error

    def _replace(self, dead: _Loader) -> None:
        logger.error(
            "an adapter loader process died (exit code %s); starting a new one", dead.process.exitcode
        )
        dead.stop()
        self._loaders[self._loaders.index(dead)] = _Loader(self._context, self.tier)


def make_loads(in_processes: bool, source: AdapterSource, tier: HostTier) -> BackgroundLoads:
    """Loader processes (as many as `default_num_loaders`), or two worker threads."""
    return ProcessLoads(source, tier) if in_processes else ThreadLoads(source, tier)
