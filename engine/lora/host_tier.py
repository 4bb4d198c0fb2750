"""The CPU tier: a fixed number of slot images in one block of host memory, allocated once at start.

Loaders write an adapter straight into a free row, and a GPU slot is filled by two asynchronous copies
out of it. Nothing is allocated, mapped or page-locked per load: when a loader process handed each
image back in fresh shared memory and the server copied it into fresh pinned memory, a load took 139 ms
instead of 41 ms (Llama-3.1-8B shape, rank 16; docs/BENCHMARKS.md, adapter loading). With `shared`, the
rows live in shared memory, so loader processes write them in place; with `pinned`, they are
page-locked (registered with CUDA), so copies to the GPU run asynchronously on a side stream.
"""

from __future__ import annotations

import math
import os
import shutil
import weakref

import torch

from engine.lora.slots import SlotImage, SlotLayout
from engine.lora.vocab import TABLE_COLUMNS


class HostTier:
    def __init__(
        self,
        layout: SlotLayout,
        dtype: torch.dtype,
        capacity: int,
        shared: bool,
        pinned: bool,
        vocab_rows: int = 0,
    ):
        """`vocab_rows`: rows 0 .. vocab_rows - 1 also have room for an adapter's own embedding and LM head
        (engine/lora/vocab.py)."""
        if capacity < 1:
            raise ValueError(f"the CPU tier needs at least one row (got {capacity})")
        self.layout, self.dtype, self.capacity = layout, dtype, capacity
        self.shared, self.pinned = shared, pinned
        self.vocab_rows = min(vocab_rows, capacity)
        table_row = (layout.shape.num_layers, layout.table_columns)
        vocab_shape = (self.vocab_rows, 2, layout.shape.vocab_size, layout.shape.hidden_size)
        self.num_bytes = capacity * (layout.numel * dtype.itemsize + table_row[0] * table_row[1] * 4)
        self.num_bytes += math.prod(vocab_shape) * dtype.itemsize
        if shared:
            _check_shared_memory(self.num_bytes)
        self.weights = torch.zeros(capacity, layout.numel, dtype=dtype)
        self.table = torch.zeros(capacity, *table_row, dtype=torch.int32)
        self.vocab = torch.zeros(vocab_shape, dtype=dtype)  # [vocab_rows, 2, vocab, hidden]
        self.vocab_table = torch.zeros(self.vocab_rows, 2, TABLE_COLUMNS, dtype=torch.int32)
        tensors = (self.weights, self.table) + ((self.vocab, self.vocab_table) if self.vocab_rows else ())
        for tensor in tensors:
            if shared:
                tensor.share_memory_()
            if (
                pinned
            ):  # registered in place: torch's pinned allocator may round the size up to a power of two
                _register(tensor)

    def image(self, row: int) -> SlotImage:
        """Row `row` as a slot image (views: what a loader writes there is what the slot copy reads)."""
        if not 0 <= row < self.capacity:
            raise ValueError(f"row {row} is outside the CPU tier's [0, {self.capacity})")
        if row < self.vocab_rows:
            return SlotImage(
                self.layout, self.weights[row], self.table[row], self.vocab[row], self.vocab_table[row]
            )
        return SlotImage(self.layout, self.weights[row], self.table[row])


def _check_shared_memory(nbytes: int, path: str = "/dev/shm") -> None:
    """Fail with the remedy now: a tier larger than the shared-memory mount kills the process with SIGBUS
    when its pages are first written (Docker's default /dev/shm is 64 MB)."""
    if not os.path.isdir(path):
        return
    free = shutil.disk_usage(path).free
    if nbytes > free:
        raise RuntimeError(
            f"the CPU tier of adapters needs {nbytes / 2**20:.0f} MiB of shared memory, but {path} has "
            f"{free / 2**20:.0f} MiB free: give the container a larger {path} (docker --shm-size, a "
            "memory-backed emptyDir in Kubernetes), lower --max-cpu-loras, or use --adapter-loader thread"
        )


def _register(tensor: torch.Tensor) -> None:
    """Page-lock memory torch did not allocate as pinned, as torch's own checkpoint stager does;
    unregistered when the tensor is freed."""
    cudart = torch.cuda.cudart()
    nbytes = tensor.numel() * tensor.element_size()
    error = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(
            f"page-locking {nbytes} bytes of shared memory for the CPU tier failed (cudaError {error})"
        )
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
