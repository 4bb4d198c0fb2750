"""Decode steps as CUDA-graph replays: one launch per step instead of hundreds of small kernels.

At start-up the runner captures one graph per batch-size bucket (1, 2, 4, ..., up to max_num_seqs) and
per LoRA use (with the LoRA kernels, and without them for steps where no token has an adapter). Every
input lives in a static buffer the graphs read: a step copies its inputs in, pads its batch up to the
bucket, replays, and reads the logits rows it needs. Mixed prefill/decode steps stay eager.

Padding rows must not disturb real ones: each writes its K/V into a scratch block that the KV cache
manager never hands out (the cache has one block more than the scheduler knows of), attends only to
that one key, uses no adapter, and its logits are dropped. Example, 3 sequences in bucket 4:
    input_ids    = [812, 77, 5, 0]               the last row is padding
    positions    = [40, 7, 19, 0]
    slot_mapping = [b0*16+8, b1*16+7, b2*16+3, pad_block*16]
    seq_lens     = [41, 8, 20, 1]
    token_slots  = [2, -1, 0, -1]
Nothing inside a captured region reads device memory back to the host: the attention and LoRA kernels
size their grids from shapes alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.lora.context import LoRAContext
from engine.model.attention import AttentionMetadata
from engine.request import NO_LORA

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself: [1, 2, 4, 8, ..., max_num_seqs]."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


@dataclass
class DecodeInputs:
    """One decode step's inputs on the host, one entry per sequence (every sequence adds one token)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    token_slots: list[int]  # NO_LORA for sequences without an adapter
    block_tables: list[list[int]]  # each sequence's block ids


class DecodeCudaGraphs:
    """Static input buffers and the captured graphs that read them."""

    def __init__(
        self,
        model,
        kv_caches,
        lora_slots,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        pad_block: int,
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.lora_slots = lora_slots
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.device = device
        n = max_num_seqs

        def buffer(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buffer(n)  # [max_num_seqs]
        self.positions = buffer(n)  # [max_num_seqs]
        self.slot_mapping = buffer(n)  # [max_num_seqs]
        self.block_tables = buffer(n, max_blocks_per_seq)  # [max_num_seqs, max_blocks_per_seq]
        self.seq_lens = buffer(n, dtype=torch.int32)  # [max_num_seqs]
        # One new token per sequence, so the start offsets never change: [0, 1, ..., max_num_seqs].
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.token_slots = buffer(n, dtype=torch.int32)  # [max_num_seqs]
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0  # steps served by a replay (tests and the benchmark read it)

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool."""
        started = time.perf_counter()
        self._fill_padding(0, self.max_batch_size)
        with torch.inference_mode():
            self._capture_all()
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.buckets,
            time.perf_counter() - started,
        )

    def _capture_all(self) -> None:
        for size in reversed(self.buckets):
            for use_lora in (True, False):
                self._forward(size, use_lora)  # warm-up: compiles the kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._forward(size, use_lora)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(size, use_lora)] = (graph, logits)

    def run(
        self, inputs: DecodeInputs
    ) -> torch.Tensor:  # [num_seqs, vocab] float32, valid until the next run
        num_seqs = len(inputs.input_ids)
        if not 0 < num_seqs <= self.max_batch_size:
            raise ValueError(
                f"a decode graph batch holds 1 to {self.max_batch_size} sequences, got {num_seqs}"
            )
        size = self.bucket(num_seqs)
        use_lora = any(slot != NO_LORA for slot in inputs.token_slots)
        self._copy_inputs(inputs)
        self._fill_padding(num_seqs, size)
        graph, logits = self.graphs[(size, use_lora)]
        graph.replay()
        self.num_replays += 1
        return logits[:num_seqs]

    def _copy_inputs(self, inputs: DecodeInputs) -> None:
        n = len(inputs.input_ids)
        width = max(len(t) for t in inputs.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in inputs.block_tables], dtype=torch.long)
        # Columns past `width` keep stale ids: the kernel never reads past a sequence's length.
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        for buffer, values in (
            (self.input_ids, inputs.input_ids),
            (self.positions, inputs.positions),
            (self.slot_mapping, inputs.slot_mapping),
            (self.seq_lens, inputs.seq_lens),
            (self.token_slots, inputs.token_slots),
        ):
            buffer[:n].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: one token in the scratch block, no adapter."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.pad_slot
        self.block_tables[start:end, 0] = self.pad_block
        self.seq_lens[start:end] = 1
        self.token_slots[start:end] = NO_LORA

    def _forward(self, size: int, use_lora: bool) -> torch.Tensor:  # [size, vocab] float32
        meta = AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,  # host copy unused by the Triton path; only its length counts
            seq_lens_tensor=self.seq_lens[:size],
            query_start_loc_tensor=self.query_start_loc[: size + 1],
        )
        lora = LoRAContext(self.lora_slots, self.token_slots[:size]) if use_lora else None
        hidden = self.model.forward(self.input_ids[:size], meta, self.kv_caches, lora)
        return self.model.compute_logits(hidden)
