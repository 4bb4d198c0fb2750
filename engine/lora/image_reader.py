"""Reading a PEFT adapter folder into a row of the CPU tier: in the calling thread, or in loader processes.

A read is mostly Python and small torch calls (the safetensors header, name and shape checks, one copy
per tensor into the image). On a thread of the serving process each of them competes with the engine
thread for the GIL, which slows the running batch (docs/BENCHMARKS.md, adapter loading).
`ProcessImageReader` does the whole read in a pool of spawned processes that write straight into the
CPU tier's shared rows; the calling thread only waits. `ThreadImageReader` reads in the calling thread:
no processes to start, for the CPU device and for tests.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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


_worker_tier: HostTier | None = None  # in a loader process: the tier, received once at start


def _start_worker(tier: HostTier) -> None:
    global _worker_tier
    _worker_tier = tier
    # One torch thread and a lower priority: a loader's copies are small, and idle OpenMP threads spin,
    # taking cores from the serving process (with torch's default of a thread per core, two loaders
    # slowed the decode steps and their own loads; docs/BENCHMARKS.md, adapter loading).
    torch.set_num_threads(1)
    os.nice(10)


def _read_in_worker(folder: str, row: int) -> None:
    read_into(_worker_tier, folder, row)


class ProcessImageReader:
    """Reads in `num_processes` spawned processes (spawned, not forked: the server holds CUDA state and
    threads that a fork would copy half-way), which receive the tier's shared memory once at start.
    They start at once, so the first load does not wait for their imports, and are replaced if one dies
    (the read it was doing fails, with the reason)."""

    def __init__(self, tier: HostTier, num_processes: int = 2):
        if not tier.shared:
            raise ValueError("loader processes need a CPU tier in shared memory (HostTier(shared=True))")
        if num_processes < 1:
            raise ValueError(f"num_processes must be positive (got {num_processes})")
        self.tier = tier
        self.num_processes = num_processes
        self._lock = threading.Lock()
        self._pool = self._start()

    def read(self, folder: Path, row: int) -> None:
        pool = self._pool
        try:
            pool.submit(_read_in_worker, str(folder), row).result()
        except BrokenProcessPool:
            self._restart(pool)
            raise AdapterError(
                "load_failed",
                f"the adapter loader process died while reading {folder} (out of memory?); the next request retries",
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(self.num_processes, context, initializer=_start_worker, initargs=(self.tier,))
        for _ in range(self.num_processes):
            pool.submit(int)  # starts the processes now, in the background
        return pool

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:  # another thread may have replaced it already
                logger.error("an adapter loader process died; starting new ones")
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._start()


def make_reader(in_processes: bool, tier: HostTier) -> ImageReader:
    return ProcessImageReader(tier) if in_processes else ThreadImageReader(tier)

