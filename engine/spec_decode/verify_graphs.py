"""Verification steps as CUDA-graph replays: every request gets a fixed lane of k + 1 token rows.

A step of speculative decoding adds 1 + (its proposals) tokens per request, 1 to k + 1, so its shape
changes every step and the decode graphs (one token per request) cannot hold it. Here each request owns
a lane of w = k + 1 consecutive rows whatever it computes: its q real tokens fill the lane's first q
rows and the rest are *ghost* rows. The lanes make the query start offsets static ([0, w, 2w, ...]),
so one graph per batch-size bucket (and LoRA use) serves every step whose requests each add 1 to w
tokens: verifications, plain decodes beside them, short prefill chunks. Example, k = 3 (w = 4), block
size 16, request A verifies 3 proposals from position 40, B decodes at position 7, bucket 2:

    lane         A: 40 41 42 43            B: 7  g  g  g
    input_ids    [x, d0, d1, d2,           y, 0, 0, 0]
    positions    [40, 41, 42, 43,          7, 0, 0, 0]
    slot_mapping [a*16+8, .., a*16+11,     b*16+7, pad, pad, pad]      (ghosts: the scratch block)
    seq_lens     [44, 11]                  (start + w: the kernel's context is seq_len - w = start)
    logits rows  [0, 1, 2, 3, 4]           (ghosts' logits are dropped)

Ghost rows cannot disturb real ones: they come after the lane's real tokens, so causal attention hides
their keys from every real row; they write K/V into the scratch block (the pad block of the decode
graphs) and use no adapter; their positions are 0 (RoPE reads no row past max_model_len). The key
positions a ghost may read past the request's blocks map to the scratch block too (block-table columns
past the request's blocks are set to it), so nothing reads outside the cache. Padding lanes (rows past
the batch) are all ghosts with a sequence length of w in the scratch block.

Real rows compute exactly what an eager step computes for them (the same kernels, the attention's
multi-token variant), so greedy tokens stay those of decoding without speculation. When the pool has
slots for adapters with their own embedding or LM head (max_vocab_loras > 0), the LoRA graphs hold that
path too, as the decode graphs do (engine/lora/vocab.py: a per-token gather and one head kernel over
every lane row, static shapes; ghost rows use no adapter and keep the base's rows), so verification
steps of such adapters replay as well.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.cuda_graphs import batch_buckets
from engine.lora.context import LoRAContext
from engine.model.attention import AttentionMetadata
from engine.request import NO_LORA
from engine.step_buffers import ROW_ALIGN, Twin

logger = logging.getLogger(__name__)


def verify_buckets(
    max_num_seqs: int, lane: int, max_num_batched_tokens: int, max_batch: int | None
) -> list[int]:
    """Batch buckets of the verification graphs: up to max_num_seqs, `max_batch` (speculation's
    disable_by_batch_size: no request speculates in larger steps) and the token budget over lanes of
    `lane` rows. Empty when not even one lane fits the budget."""
    limit = min(max_num_seqs, max_num_batched_tokens // lane)
    if max_batch is not None:
        limit = min(limit, max_batch)
    return batch_buckets(limit) if limit >= 1 else []


class VerifyTwins:
    """The graphs' static inputs (`device` sides) and their page-locked hosts, one lane of rows per request."""

    def __init__(self, max_batch: int, lane: int, max_blocks: int, device: torch.device):
        rows = -(-max_batch * lane // ROW_ALIGN) * ROW_ALIGN
        self.longs = Twin((3, rows), torch.long, device)  # input ids, positions, slot mapping
        self.token_slots = Twin((rows,), torch.int32, device)  # NO_LORA for ghosts
        self.seq_lens = Twin((max_batch,), torch.int32, device)  # per lane: start + lane
        self.logits_rows = Twin((rows,), torch.long, device)  # read outside the graph
        # host: [size, width] packed at the front; device: [max_batch, max_blocks]
        self.block_tables = Twin((max_batch * max_blocks,), torch.long, device)
        self.block_tables.device = self.block_tables.device.view(max_batch, max_blocks)
        self.query_start_loc = torch.arange(
            0, (max_batch + 1) * lane, lane, dtype=torch.int32, device=device
        )  # [max_batch + 1], static

    def send(self, size: int, lane: int, width: int, num_logits_rows: int) -> None:
        """Rows of `size` lanes; block tables [size, width] (columns past width are never read)."""
        self.longs.send_rows(size * lane)
        self.token_slots.send(size * lane)
        self.seq_lens.send(size)
        self.logits_rows.send(num_logits_rows)
        host = self.block_tables.host[: size * width].view(size, width)
        self.block_tables.device[:size, :width].copy_(host, non_blocking=True)


class VerifyCudaGraphs:
    """One graph per (bucket, LoRA use) over lanes of k + 1 rows; `fits` picks the steps they serve.

    Without `capture` (the CPU, in tests) `replay` runs the same forward eagerly on the static buffers,
    so the lane layout is checked where no graph can be captured."""

    def __init__(self, runner, num_speculative_tokens: int, max_batch: int | None = None):
        config = runner.config
        self.model = runner.model
        self.kv_caches = runner.kv_caches
        self.lora_slots = runner.lora_slots
        self.device = runner.device
        self.lane = num_speculative_tokens + 1
        self.block_size = runner.block_size
        self.pad_block = runner.pad_block
        self.buckets = verify_buckets(
            config.max_num_seqs, self.lane, config.max_num_batched_tokens, max_batch
        )
        # Ghost rows may sit up to k positions past max_model_len - 1: their columns must exist.
        self.max_blocks = -(-(runner.max_model_len + self.lane) // self.block_size)
        self.inputs = VerifyTwins(max(self.buckets, default=1), self.lane, self.max_blocks, self.device)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0  # steps served by this path (tests and the benchmark read it)

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    def fits(self, scheduled) -> bool:
        """Every request adds 1 to k + 1 tokens, some more than one (else the decode graphs serve the
        step), in a batch a bucket holds."""
        if not 0 < len(scheduled) <= self.max_batch_size:
            return False
        counts = [s.num_new_tokens for s in scheduled]
        return max(counts) > 1 and max(counts) <= self.lane and min(counts) >= 1

    # -- capture ----------------------------------------------------------------------------------------

    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, in `pool` (the decode graphs': never replayed together);
        off CUDA only the padding lanes are set (replays run uncaptured)."""
        started = time.perf_counter()
        self.pool = pool
        self._fill_padding(self.max_batch_size)
        if self.device.type != "cuda":
            return
        with torch.inference_mode():
            for size in reversed(self.buckets):
                for use_lora in (True, False):
                    self._forward(size, use_lora)  # compiles the kernels outside the capture
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        logits = self._forward(size, use_lora)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[(size, use_lora)] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d verification CUDA graphs (lanes of %d tokens, batch sizes %s) in %.1f s",
            len(self.graphs),
            self.lane,
            self.buckets,
            time.perf_counter() - started,
        )

    def _fill_padding(self, size: int) -> None:
        """Every lane a padding lane, on the device (capture only)."""
        inputs, rows = self.inputs, size * self.lane
        inputs.longs.device[:, :rows] = 0
        inputs.longs.device[2, :rows] = self.pad_block * self.block_size
        inputs.token_slots.device[:rows] = NO_LORA
        inputs.seq_lens.device[:size] = self.lane
        inputs.block_tables.device[:size] = self.pad_block

    def _forward(self, size: int, use_lora: bool) -> torch.Tensor:  # [size * lane, vocab] float32
        inputs, lane = self.inputs, self.lane
        rows = size * lane
        meta = AttentionMetadata(
            positions=inputs.longs.device[1, :rows],
            slot_mapping=inputs.longs.device[2, :rows],
            block_tables=inputs.block_tables.device[:size],
            query_start_loc=list(range(0, (size + 1) * lane, lane)),  # host: only max_query_len is read
            seq_lens=[lane] * size,  # host copy unused by the Triton path; only its length counts
            seq_lens_tensor=inputs.seq_lens.device[:size],
            query_start_loc_tensor=inputs.query_start_loc[: size + 1],
        )
        lora = None
        if use_lora:  # with vocab slots, adapters' own embeddings and heads too (as the decode graphs)
            vocab = self.lora_slots.vocab is not None
            lora = LoRAContext(self.lora_slots, inputs.token_slots.device[:rows], vocab=vocab)
        hidden = self.model.forward(inputs.longs.device[0, :rows], meta, self.kv_caches, lora)
        own = lora.own_heads() if lora is not None and lora.vocab else None  # ghost rows: NO_LORA, base
        return self.model.compute_logits(hidden, own)

    # -- one step ---------------------------------------------------------------------------------------

    def execute(self, batch, scheduled, in_flight=None, parallel=None) -> torch.Tensor:
        """Fill the lanes from the input batch (rows already updated), replay, and return the logits rows
        that sample ([num_sampling_rows, vocab] float32, in the eager path's order). `parallel`: rank 0's
        TensorParallelRank, which hands the lanes to the workers before every rank replays."""
        size = next(b for b in self.buckets if b >= len(scheduled))
        use_lora, num_rows = batch.prepare_lanes(scheduled, self.inputs, size, self.lane, in_flight)
        if parallel is not None:
            parallel.send_verify(self.inputs, size, use_lora)
        logits = self.replay(size, use_lora)
        return logits[self.inputs.logits_rows.device[:num_rows]]

    def replay(self, size: int, use_lora: bool) -> torch.Tensor:  # [size * lane, vocab] float32
        """Run the graph of bucket `size` on the lanes already in the static buffers (a worker calls it
        after receiving rank 0's); uncaptured off CUDA."""
        key = (size, use_lora)
        if key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
        elif self.device.type == "cuda":
            raise RuntimeError(f"no verification graph was captured for batch size {size}")
        else:
            logits = self._forward(size, use_lora)
        self.num_replays += 1
        return logits
