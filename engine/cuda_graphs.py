"""Decode steps as CUDA-graph replays: one launch per step instead of hundreds of small kernels.

At start-up the runner captures one graph per batch-size bucket (1, 2, 4, ..., up to max_num_seqs) and
per LoRA use: without the LoRA kernels, for steps where no token has an adapter, and with them sized to
each of the pool's rank variants (engine/lora/pool.LoRAPool.bucket_variants: each rank bucket alone, and
all of them), so a step of rank-16 adapters in a pool for rank 64 replays kernels sized for 16. Every
input lives in a static buffer the graphs read: a step copies its inputs in with padding rows up to the
bucket (InputBatch.prepare_decode, one copy per buffer), replays, and reads the logits rows it needs.
Steps with prefill tokens replay the piecewise graphs instead (engine/piecewise_graphs.py: everything but
attention, per token-count bucket, up to 2048 tokens; larger ones run eagerly). When the pool has slots for adapters with their own embedding or
LM head (max_vocab_loras > 0), the LoRA graphs also hold that path (engine/lora/vocab.py: a per-token
gather and one head kernel, static shapes), so steps of such adapters replay too; without them the
graphs are as before.

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

Under tensor parallelism every rank captures the same graphs in the same order, the NCCL all-reduces and
the logits all-gather inside them; rank 0 broadcasts its static buffers into the workers' before each
replay (engine/parallel/rank.py).

Off CUDA nothing is captured: with UNCAPTURED_GRAPHS_ENV set (tests, on the interpreted Triton kernels),
the runner still builds these objects and `replay` runs the same forward on the static buffers, so the
buffers, the buckets and the tensor-parallel graph steps are exercised on the CPU.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.lora.context import LoRAContext
from engine.model.attention import AttentionMetadata
from engine.request import NO_LORA
from engine.step_buffers import DecodeTwins

logger = logging.getLogger(__name__)

# "1": build the graph paths on the CPU too, replayed uncaptured (tests of their inputs; see above).
UNCAPTURED_GRAPHS_ENV = "LORASERVE_UNCAPTURED_GRAPHS"


def graphs_wanted(config) -> bool:
    """Whether the runner builds decode graphs: captured on CUDA, uncaptured on the CPU for tests."""
    if config.use_cuda_graphs:
        return True
    return (
        os.environ.get(UNCAPTURED_GRAPHS_ENV) == "1"
        and not config.enforce_eager
        and config.torch_device.type != "cuda"
        and config.resolved_attention_backend == "triton"
    )


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself: [1, 2, 4, 8, ..., max_num_seqs]."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


class DecodeCudaGraphs:
    """The captured graphs and the static input buffers they read (filled by InputBatch.prepare_decode)."""

    def __init__(
        self,
        model,
        kv_caches,
        lora_slots,
        inputs: DecodeTwins,
        max_num_seqs: int,
        pad_block: int,
        block_size: int,
        device: torch.device,
        variants: list[tuple[int, ...]] | None = None,
    ):
        """`variants`: the rank buckets LoRA steps may be sized to (default: the pool's kernel rank only,
        as under tensor parallelism, whose workers replay what rank 0 names with a bool)."""
        self.model = model
        self.kv_caches = kv_caches
        self.lora_slots = lora_slots
        self.inputs = inputs
        self.buckets = batch_buckets(max_num_seqs)
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.device = device
        self.variants = variants or [(lora_slots.kernel_rank,)]
        # (size, rank buckets) -> graph and its logits; () for the graphs without LoRA
        self.graphs: dict[tuple[int, tuple[int, ...]], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0  # steps served by a replay (tests and the benchmark read it)

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool (off CUDA only
        the padding rows are set: replays run uncaptured)."""
        started = time.perf_counter()
        self._fill_padding(0, self.max_batch_size)
        if self.device.type != "cuda":
            return
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
            for lora in [*self.variants, ()]:
                self._forward(size, lora)  # warm-up: compiles the kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    logits = self._forward(size, lora)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(size, lora)] = (graph, logits)

    def replay(
        self, num_seqs: int, size: int, use_lora: bool, rank_buckets: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Run the graph of bucket `size` on the inputs already in the static buffers (rows [num_seqs, size)
        padding), with the LoRA kernels sized to `rank_buckets` (one of the variants; None: the last, all
        of them); returns [num_seqs, vocab] float32 logits, valid until the next replay."""
        if not 0 < num_seqs <= size or size not in self.buckets:
            raise ValueError(f"no decode graph for {num_seqs} sequences in a bucket of {size}")
        lora = (rank_buckets or self.variants[-1]) if use_lora else ()
        if lora not in self.variants and lora != ():
            raise ValueError(f"no decode graph for rank buckets {lora}; captured: {self.variants}")
        if self.device.type == "cuda":
            graph, logits = self.graphs[(size, lora)]
            graph.replay()
        else:  # uncaptured (tests): the same forward on the same buffers
            logits = self._forward(size, lora)
        self.num_replays += 1
        return logits[:num_seqs]

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: one token in the scratch block, no adapter (capture only)."""
        inputs = self.inputs
        inputs.input_ids[start:end] = 0
        inputs.positions[start:end] = 0
        inputs.slot_mapping[start:end] = self.pad_slot
        inputs.block_tables.device[start:end, 0] = self.pad_block
        inputs.seq_lens[start:end] = 1
        inputs.token_slots[start:end] = NO_LORA

    def _forward(self, size: int, lora: tuple[int, ...]) -> torch.Tensor:  # [size, vocab] float32
        inputs = self.inputs
        meta = AttentionMetadata(
            positions=inputs.positions[:size],
            slot_mapping=inputs.slot_mapping[:size],
            block_tables=inputs.block_tables.device[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,  # host copy unused by the Triton path; only its length counts
            seq_lens_tensor=inputs.seq_lens[:size],
            query_start_loc_tensor=inputs.query_start_loc[: size + 1],
        )
        context = None
        if lora:  # with vocab slots, the LoRA graphs hold adapters' own embeddings and heads too
            vocab = self.lora_slots.vocab is not None
            context = LoRAContext(self.lora_slots, inputs.token_slots[:size], lora, vocab=vocab)
        hidden = self.model.forward(inputs.input_ids[:size], meta, self.kv_caches, context)
        own = context.own_heads() if context is not None and context.vocab else None
        return self.model.compute_logits(hidden, own)
