"""Reading a PEFT adapter folder into a slot image: in the calling thread, or in loader processes.

A read is mostly Python and small torch calls (the safetensors header, name and shape checks, one copy
per tensor into the image). On a thread of the serving process each of them competes with the engine
thread for the GIL, and every load slowed the running batch by milliseconds (docs/BENCHMARKS.md,
adapter loading). `ProcessImageReader` does the whole read in a pool of spawned processes that build
the image in shared memory; the calling thread only waits for it and copies it into pinned memory with
one call per tensor, which runs without the GIL. `ThreadImageReader` reads in the calling thread: no
processes to start, for the CPU device and for tests.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Protocol

import torch

from engine.lora.peft_checkpoint import AdapterError, load_peft_adapter
from engine.lora.slots import SlotImage, SlotLayout, build_image

logger = logging.getLogger(__name__)

class ImageReader(Protocol):
    def read(self, folder: Path) -> SlotImage:
        """Validate the adapter in `folder` against the model and lay it out as one slot (AdapterError if
        it cannot be served). Called on the adapter manager's worker threads."""

    def close(self) -> None:
        """Release what the reader holds (its processes); reads already running may fail."""


def read_image(folder: str | Path, layout: SlotLayout, dtype: torch.dtype, pin_memory: bool, share_memory: bool):
    """The whole read: validate against the layout's model and rank, then lay out (one function, so a
    loader process runs all of it)."""
    adapter = load_peft_adapter(folder, layout.shape, layout.max_rank)
    return build_image(layout, dtype, adapter, pin_memory=pin_memory, share_memory=share_memory)


class ThreadImageReader:
    def __init__(self, layout: SlotLayout, dtype: torch.dtype, pin_memory: bool):
        self.layout, self.dtype, self.pin_memory = layout, dtype, pin_memory

    def read(self, folder: Path) -> SlotImage:
        return read_image(folder, self.layout, self.dtype, self.pin_memory, share_memory=False)

    def close(self) -> None:
        pass


def _read_shared(folder: str, layout: SlotLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs in a loader process; the tensors travel back as shared-memory handles, not bytes."""
    image = read_image(folder, layout, dtype, pin_memory=False, share_memory=True)
    return image.weights, image.table


def _start_worker() -> None:
    # One thread: the copies are small, and the serving process's threads need the cores more.
    torch.set_num_threads(1)


class ProcessImageReader:
    """Reads in `num_processes` spawned processes (spawned, not forked: the server holds CUDA state and
    threads that a fork would copy half-way). They start at once, so the first load does not wait for
    their imports, and are replaced if one dies (the read it was doing fails, with the reason)."""

    def __init__(self, layout: SlotLayout, dtype: torch.dtype, pin_memory: bool, num_processes: int = 2):
        if num_processes < 1:
            raise ValueError(f"num_processes must be positive (got {num_processes})")
        self.layout, self.dtype, self.pin_memory = layout, dtype, pin_memory
        self.num_processes = num_processes
        self._lock = threading.Lock()
        self._pool = self._start()

    def read(self, folder: Path) -> SlotImage:
        pool = self._pool
        try:
            weights, table = pool.submit(_read_shared, str(folder), self.layout, self.dtype).result()
        except BrokenProcessPool:
            self._restart(pool)
            raise AdapterError(
                "load_failed",
                f"the adapter loader process died while reading {folder} (out of memory?); the next request retries",
            ) from None
        return SlotImage(self.layout, self._own(weights), self._own(table))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _own(self, shared: torch.Tensor) -> torch.Tensor:
        """A private (pinned) copy, so the shared segment is freed now and the copy to the GPU is async."""
        local = torch.empty(shared.shape, dtype=shared.dtype, pin_memory=self.pin_memory)
        local.copy_(shared)
        return local

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            self.num_processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker
        )
        for _ in range(self.num_processes):
            pool.submit(int)  # starts the processes now, in the background
        return pool

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:  # another thread may have replaced it already
                logger.error("an adapter loader process died; starting new ones")
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._start()


def make_reader(in_processes: bool, layout: SlotLayout, dtype: torch.dtype, device: torch.device) -> ImageReader:
    """The reader for an engine (EngineConfig.loads_in_processes); images are pinned when `device` is CUDA."""
    cuda = device.type == "cuda"
    if in_processes:
        return ProcessImageReader(layout, dtype, pin_memory=cuda)
    return ThreadImageReader(layout, dtype, pin_memory=cuda)
