"""Host/device buffer pairs for a step's inputs: filled on the host, sent with one copy each.

On CUDA the host side is page-locked, so `copy_(non_blocking=True)` queues a DMA and returns at once
(from pageable memory the copy would first wait for the GPU to finish everything queued before it).
The host side is reused every step: InputBatch waits for the previous step's copies before writing it.
Rows of the 2-D buffers are padded to 16 elements so every row view starts 64-byte aligned (Triton
specialises pointers on 16-byte alignment). On the CPU both sides are plain tensors.
"""

from __future__ import annotations

import numpy as np
import torch

ROW_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


class Twin:
    """One host buffer (with a numpy view) and its device twin of the same shape."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        pinned = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        self.host_np: np.ndarray = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device)

    def send(self, count: int | None = None) -> None:
        """Copy everything, or the first `count` elements of a 1-D buffer."""
        if count is None:
            self.device.copy_(self.host, non_blocking=True)
        elif count > 0:
            self.device[:count].copy_(self.host[:count], non_blocking=True)

    def send_rows(self, count: int) -> None:
        """The first `count` columns of each row of a 2-D buffer, one copy per row (each contiguous)."""
        for row in range(self.host.shape[0]):
            self.device[row, :count].copy_(self.host[row, :count], non_blocking=True)


class DecodeTwins:
    """The decode graphs' static inputs (the `device` sides, which the graphs read) and their hosts."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        rows = _aligned(max_num_seqs)
        self.longs = Twin((3, rows), torch.long, device)  # input ids, positions, slot mapping
        self.ints = Twin((2, rows), torch.int32, device)  # sequence lengths, token slots (NO_LORA: none)
        # host: [size, width] packed at the front; device: [max_num_seqs, max_blocks_per_seq]
        self.block_tables = Twin((max_num_seqs * max_blocks_per_seq,), torch.long, device)
        self.block_tables.device = self.block_tables.device.view(max_num_seqs, max_blocks_per_seq)
        # One new token per sequence, so the start offsets never change: [0, 1, ..., max_num_seqs].
        self.query_start_loc = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)

    @property
    def input_ids(self) -> torch.Tensor:  # [rows] int64
        return self.longs.device[0]

    @property
    def positions(self) -> torch.Tensor:  # [rows] int64
        return self.longs.device[1]

    @property
    def slot_mapping(self) -> torch.Tensor:  # [rows] int64
        return self.longs.device[2]

    @property
    def seq_lens(self) -> torch.Tensor:  # [rows] int32
        return self.ints.device[0]

    @property
    def token_slots(self) -> torch.Tensor:  # [rows] int32
        return self.ints.device[1]

    def send(self, size: int, width: int) -> None:
        """Rows [0, size) of everything; block tables [size, width] (columns past width keep stale ids,
        which no kernel reads: they lie past every sequence's length)."""
        self.longs.send()
        self.ints.send()
        host = self.block_tables.host[: size * width].view(size, width)
        self.block_tables.device[:size, :width].copy_(host, non_blocking=True)


class EagerTwins:
    """Inputs of steps that run eagerly (prefill, mixed, and decode without graphs)."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, device: torch.device):
        self.longs = Twin((3, _aligned(max_num_tokens)), torch.long, device)  # input ids, positions, slots
        self.token_slots = Twin((max_num_tokens,), torch.int32, device)
        # sequence lengths [num_seqs], query start offsets [num_seqs + 1]
        self.ints = Twin((2, _aligned(max_num_seqs + 1)), torch.int32, device)
        # One row per sampling request, more with speculative proposals (never more than the tokens).
        self.logits_rows = Twin((max(max_num_seqs, max_num_tokens),), torch.long, device)
        self.block_tables = Twin(
            (max_num_seqs * max_blocks_per_seq,), torch.long, device
        )  # [n, width] packed

    def send(self, num_tokens: int, table_size: int, num_logits_rows: int, use_lora: bool) -> None:
        self.longs.send_rows(num_tokens)
        if use_lora:
            self.token_slots.send(num_tokens)
        self.ints.send()
        self.logits_rows.send(num_logits_rows)
        self.block_tables.send(table_size)
