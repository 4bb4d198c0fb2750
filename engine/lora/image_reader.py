"""Reading a PEFT adapter folder into a row of the CPU tier: in the calling thread, or in loader processes.

A read is mostly Python and small torch calls (the safetensors header, name and shape checks, one copy
per tensor into the image). On a thread of the serving process each of them competes with the engine
thread for the GIL, which slows the running batch (docs/BENCHMARKS.md, adapter loading).
`ProcessImageReader` does the whole read in spawned processes that write straight into the CPU tier's
shared rows; the calling thread only sends the job down a pipe and waits for the answer.
`ThreadImageReader` reads in the calling thread: no processes to start, for the CPU device and for tests.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import torch

from engine.lora.host_tier import HostTier
from engine.lora.peft_checkpoint import AdapterError, load_peft_adapter
from engine.lora.slots import build_image

logger = logging.getLogger(__name__)


class ImageReader(Protocol):
    tier: HostTier

    def read(self, folder: Path, row: int) -> None:
        """Validate the adapter in `folder` against the model and lay it out in row `row` of the tier
        (AdapterError if it cannot be served). Called on the adapter manager's worker threads; the caller
        owns the row until this returns."""

    def close(self) -> None:
        """Release what the reader holds (its processes); reads already running may fail."""


def read_into(tier: HostTier, folder: str | Path, row: int) -> None:
    """The whole read (one function, so a loader process runs all of it)."""
    adapter = load_peft_adapter(folder, tier.layout.shape, tier.layout.max_rank)
    build_image(tier.layout, tier.dtype, adapter, out=tier.image(row))


class ThreadImageReader:
    def __init__(self, tier: HostTier):
        self.tier = tier

    def read(self, folder: Path, row: int) -> None:
        read_into(self.tier, folder, row)

    def close(self) -> None:
        pass


def _serve(conn: Connection, tier: HostTier) -> None:
    """A loader process: reads (folder, row) jobs from its pipe until it closes, answering each with None
    or the exception the read raised."""
    # One torch thread and a lower priority: a loader's copies are small, and idle OpenMP threads spin,
    # taking cores from the serving process (with torch's default of a thread per core, two loaders
    # slowed the decode steps and their own loads; docs/BENCHMARKS.md, adapter loading).
    torch.set_num_threads(1)
    os.nice(10)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the serving process closed its end, or exited
            return
        try:
            read_into(tier, *job)
        except Exception as exc:  # the read's own failure, for the caller to raise
            error = exc
        else:
            error = None
        try:
            conn.send(_picklable(error))
        except OSError:  # closed while this read ran
            return


def _picklable(error: Exception | None) -> Exception | None:
    """The error itself where it pickles (AdapterError keeps its code), else its text."""
    try:
        pickle.dumps(error)
    except Exception:
        return AdapterError("load_failed", f"{type(error).__name__}: {error}")
    return error


class _Loader:
    """One loader process and the serving process's end of its pipe."""

    def __init__(self, context, tier: HostTier):
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_end, tier), name="adapter-loader", daemon=True)
        self.process.start()  # returns at once; the process imports in the background
        child_end.close()  # so a dead process reads as EOF here, not as a read that never ends

    def call(self, folder: str, row: int) -> Exception | None:
        self.conn.send((folder, row))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.close()  # the process sees EOF and exits once its current read (if any) ends


class ProcessImageReader:
    """Reads in `num_processes` spawned processes (spawned, not forked: the server holds CUDA state and
    threads that a fork would copy half-way), which receive the tier's shared memory once at start.
    They start at once, so the first load does not wait for their imports; one that dies is replaced
    (the read it was doing fails, with the reason).

    Each process has its own pipe, and the thread that reads sends the job and waits on that pipe
    itself: no helper threads in the serving process (a ProcessPoolExecutor runs two, whose wake-ups
    per load took the GIL from the engine thread; docs/BENCHMARKS.md, adapter loading)."""

    def __init__(self, tier: HostTier, num_processes: int = 2):
        if not tier.shared:
            raise ValueError("loader processes need a CPU tier in shared memory (HostTier(shared=True))")
        if num_processes < 1:
            raise ValueError(f"num_processes must be positive (got {num_processes})")
        self.tier = tier
        self.num_processes = num_processes
        self._context = multiprocessing.get_context("spawn")
        self._loaders = [_Loader(self._context, tier) for _ in range(num_processes)]
        self._closed = False
        self._idle: queue.SimpleQueue[_Loader] = queue.SimpleQueue()  # a reading thread owns its loader
        for loader in self._loaders:
            self._idle.put(loader)

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        return [loader.process for loader in self._loaders]

    def read(self, folder: Path, row: int) -> None:
        loader = self._idle.get()  # waits while every process is reading
        try:
            if self._closed:
                raise AdapterError("load_failed", "the adapter loader processes were shut down")
            error = loader.call(str(folder), row)
        except (EOFError, OSError):  # the process died (killed, out of memory) or was closed
            if self._closed:
                raise AdapterError("load_failed", "the adapter loader processes were shut down") from None
            loader = self._replace(loader)
            raise AdapterError(
                "load_failed",
                f"the adapter loader process died while reading {folder} (out of memory?); the next request retries",
            ) from None
        finally:
            self._idle.put(loader)
        if error is not None:
            raise error

    def close(self) -> None:
        self._closed = True
        for loader in self._loaders:
            loader.stop()

    def _replace(self, dead: _Loader) -> _Loader:
        logger.error("an adapter loader process died (exit code %s); starting a new one", dead.process.exitcode)
        dead.stop()
        loader = _Loader(self._context, self.tier)
        self._loaders[self._loaders.index(dead)] = loader
        return loader


def make_reader(in_processes: bool, tier: HostTier) -> ImageReader:
    return ProcessImageReader(tier) if in_processes else ThreadImageReader(tier)

