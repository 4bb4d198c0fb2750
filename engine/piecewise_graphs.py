"""Mixed prefill/decode steps as piecewise CUDA graphs: everything but attention replayed per token bucket.

A step that holds a prefill chunk cannot replay a decode graph: its attention reads per-request host
metadata (query lengths, the longest query) that changes every step. Everything else in the model works
token by token, so, as vLLM's piecewise graphs do, the forward is cut at each attention kernel:

    piece 0        embedding .. layer 0's input norm, q/k/v projection + LoRA, RoPE, K/V write -> q
    attention 0    eager: the paged kernel over the real tokens (variable-length prefill and decode)
    piece i        layer i-1's o_proj + LoRA, norms, MLP + LoRA, then layer i's queries as piece 0
    ...
    piece L        layer L-1's o_proj .. MLP, the final norm -> hidden

and each piece is captured once per token-count bucket (`token_buckets`) and LoRA use (none, or the
kernels sized to all of the pool's rank buckets: correct for any step's adapters, so one LoRA variant
per bucket, not one per rank-bucket subset as the decode graphs hold). The logits of the sampled rows
(and prompt logprobs, adapters' own heads) are computed eagerly from the last piece's hidden rows: a
head over every padded row would cost more than its launch. DecoderModel.forward runs the same layer
methods (attention_input, attend, attention_output) in the same order, so eager steps and replays run
the same ops.

Static buffers: the token inputs are the eager step's own (InputBatch.prepare_eager fills input ids,
positions, slot mapping and per-token adapter slots with padding rows up to the bucket); between pieces
the queries, the attention output and the residual stream live in buffers of max tokens rows that every
bucket shares (a piece copies its queries in; the fused norms update the residual in place). Padding
rows are token 0 at position 0 with no adapter, their K/V written into the scratch block the decode
graphs use; the attention kernel never sees them (it runs on the real tokens alone), and nothing mixes
rows, so real rows are exact. Example, 5 real tokens in bucket 16:
    input_ids    = [812, 77, 5, 9, 31, 0, ..., 0]
    slot_mapping = [b0*16+8, b1*16+0, b1*16+1, b1*16+2, b1*16+3, pad, ..., pad]
    token_slots  = [2, -1, -1, -1, -1, -1, ..., -1]

Buckets: powers of two from 16 and 1.5x each (16, 24, 32, 48, 64, ..., 1536, 2048), then the largest
size itself, up to min(max_num_batched_tokens, PIECEWISE_MAX_TOKENS): at most a third of the compute is
padding, and 15 buckets x 2 LoRA uses x (layers + 1) graphs (990 for 32 layers). Larger steps run
eagerly: their kernels take long enough that launch overhead matters less, and the graphs' memory pool
holds about one forward of the largest bucket (the KV cache was sized before capture; capture time and
memory are logged).

Which steps and models use them is decided in one place, `piecewise_unsupported`: off for tensor
parallelism (the workers replay only what rank 0 broadcasts), which keeps the eager path, as does an
engine whose capture failed (model_runner logs why). Mixture-of-experts models go through the pieces:
piece 0 marks the real rows (slot mapping outside the scratch block) and the MoE layers' routing counts
leave the padding rows out. DoRA, adapters' own embeddings (inside piece 0, the decode graphs' static
path), prompt logprobs and speculative verification steps that no verification graph holds go through
the pieces. Piece 0 also builds the LoRA kernels' per-step token groups (LoRABatchMeta) inside its graph;
the later pieces read them.

Off CUDA nothing is captured: with UNCAPTURED_GRAPHS_ENV set, the pieces run uncaptured on the same
buffers, padding included, so CPU tests exercise the buckets and the padding.
"""

from __future__ import annotations

import gc
import logging
import time
from unittest import mock

import torch

from engine.lora.context import LoRAContext
from engine.model.attention import AttentionMetadata
from engine.request import NO_LORA
from engine.step_buffers import EagerTwins

logger = logging.getLogger(__name__)

MIN_BUCKET = 16
# The largest step the pieces hold; larger ones run eagerly (bounds the graphs' memory and count).
PIECEWISE_MAX_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16 and 1.5x each below max_tokens, then max_tokens:
    token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]."""
    sizes = []
    size = MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        if size * 3 // 2 < max_tokens:
            sizes.append(size * 3 // 2)
        size *= 2
    return [*sizes, max_tokens]


def piecewise_unsupported(config, model, parallel) -> str | None:
    """Why mixed steps run eagerly on this engine, or None when the pieces serve them (the one place
    that decides; the decode graphs must be on too)."""
    if not config.piecewise_cuda_graphs:
        return "piecewise_cuda_graphs is off"
    if parallel is not None:
        return "tensor parallelism"
    return None


class PiecewiseCudaGraphs:
    """The captured pieces of every (bucket, LoRA use) and the buffers between them."""

    def __init__(
        self,
        model,
        kv_caches,
        lora_slots,
        inputs: EagerTwins,
        max_num_tokens: int,
        pad_slot: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.lora_slots = lora_slots
        self.inputs = inputs
        self.buckets = token_buckets(min(max_num_tokens, PIECEWISE_MAX_TOKENS))
        self.pad_slot = pad_slot
        self.device = device
        self.variant = lora_slots.bucket_variants()[-1]  # every rank bucket: holds any step's adapters
        self.num_pieces = model.num_layers + 1
        self.moe_layers = getattr(model, "moe_layers", [])  # (MoEDecoderModel) their routing counts
        self._real_rows: torch.Tensor | None = None  # [size] bool: piece 0's, for the MoE layers' counts
        rows, attn = self.buckets[-1], model.num_heads * model.head_dim
        dtype = model.model.embed_tokens.weight.dtype
        self.queries = torch.zeros(rows, attn, dtype=dtype, device=device)  # [rows, heads * head_dim]
        self.attn_out = torch.zeros(rows, attn, dtype=dtype, device=device)  # the kernel writes here
        hidden = model.config.hidden_size
        self.residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)  # the last piece's output
        # (bucket, rank buckets or () without LoRA) -> its pieces' graphs, then what piece 0 built that
        # later pieces read (kept alive): the LoRA context (its plans and token groups), the real-row mask
        self.graphs: dict[
            tuple[int, tuple[int, ...]],
            tuple[list[torch.cuda.CUDAGraph], LoRAContext | None, torch.Tensor | None],
        ]
        self.graphs = {}
        self.pool = None
        self.num_replays = 0  # steps served by the pieces (tests and the benchmark read it)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens` tokens; None past the largest (eager)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def capture(self, pool=None) -> None:
        """Capture every bucket's pieces, largest first, into `pool` (the decode graphs' memory pool) so
        smaller ones reuse its memory; off CUDA only the padding rows are set."""
        started = time.perf_counter()
        self._fill_padding(0, self.max_tokens)
        if self.device.type != "cuda":
            return
        self.pool = pool
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        # Hundreds of captures: each would empty the allocator's cache (and, on some torch releases,
        # collect garbage) on entering torch.cuda.graph; once, above, is enough (vLLM does the same).
        with (
            torch.inference_mode(),
            mock.patch("gc.collect", lambda *args, **kwargs: 0),
            mock.patch("torch.cuda.empty_cache", lambda: None),
        ):
            try:
                for size in reversed(self.buckets):
                    for lora in (self.variant, ()):
                        self._capture_bucket(size, lora)
            finally:  # each graph keeps its own mask; later forwards set theirs (MoEDecoderModel.forward)
                for moe in self.moe_layers:
                    moe.count_mask = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what the warm-up runs left cached: the graphs hold their own pool
        logger.info(
            "captured %d piecewise CUDA graphs for mixed steps (%d pieces x token buckets %s x %d LoRA "
            "uses) in %.1f s, %.0f MiB",
            sum(len(entry[0]) for entry in self.graphs.values()),
            self.num_pieces,
            self.buckets,
            2,
            time.perf_counter() - started,
            (torch.cuda.memory_reserved(self.device) - before) / 2**20,
        )

    def _capture_bucket(self, size: int, lora: tuple[int, ...]) -> None:
        # Warm-up outside the capture compiles the kernels; its context is dropped so that the captured
        # piece 0 builds the token groups the later pieces read (a warm-up's would go stale).
        context = self._context(size, lora)
        for index in range(self.num_pieces):
            self._piece(index, size, context)
        torch.cuda.synchronize(self.device)
        context = self._context(size, lora)
        graphs = []
        for index in range(self.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._piece(index, size, context)
            if self.pool is None:
                self.pool = graph.pool()
            graphs.append(graph)
        self.graphs[(size, lora)] = (graphs, context, self._real_rows)

    def run(
        self, num_tokens: int, size: int, meta: AttentionMetadata, use_lora: bool
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """One step whose inputs are in the eager buffers, padded to bucket `size`; `meta` is the step's
        attention metadata over its real tokens. Returns the final-norm hidden rows, valid until the next
        step."""
        if not 0 < num_tokens <= size or size not in self.buckets:
            raise ValueError(f"no piecewise graphs for {num_tokens} tokens in a bucket of {size}")
        lora = self.variant if use_lora else ()
        captured = self.device.type == "cuda"
        if captured:
            graphs = self.graphs[(size, lora)][0]
        else:  # uncaptured (tests): the same pieces on the same buffers, a context per step as eager
            context = self._context(size, lora)
        heads, head_dim = self.model.num_heads, self.model.head_dim
        queries = self.queries[:num_tokens].view(num_tokens, heads, head_dim)
        attn_out = self.attn_out[:num_tokens].view(num_tokens, heads, head_dim)
        for index in range(self.num_pieces):
            if captured:
                graphs[index].replay()
            else:
                self._piece(index, size, context)
            if index < self.model.num_layers:
                self.model.attend(index, queries, meta, self.kv_caches, out=attn_out)
        self.num_replays += 1
        return self.hidden[:num_tokens]

    def _context(self, size: int, lora: tuple[int, ...]) -> LoRAContext | None:
        if not lora:
            return None
        vocab = self.lora_slots.vocab is not None  # as the eager steps and decode graphs run it
        return LoRAContext(self.lora_slots, self.inputs.token_slots.device[:size], lora, vocab=vocab)

    def _piece(self, index: int, size: int, context: LoRAContext | None) -> None:
        """Piece `index` over the first `size` rows of the static buffers (captured, or run as is)."""
        longs = self.inputs.longs.device
        # Only the token-level fields are read inside a piece; the attention gets the step's own meta.
        meta = AttentionMetadata(
            positions=longs[1, :size], slot_mapping=longs[2, :size], block_tables=None,
            query_start_loc=[], seq_lens=[],
        )  # fmt: skip
        model, residual = self.model, self.residual[:size]
        if index == 0:
            if self.moe_layers:  # routing counts leave the padding rows out (computed in the graph)
                self._real_rows = longs[2, :size] != self.pad_slot
                for moe in self.moe_layers:
                    moe.count_mask = self._real_rows
            q, res = model.first_piece(longs[0, :size], meta, self.kv_caches, context)
        else:
            q, res = model.piece(index, self.attn_out[:size], residual, meta, self.kv_caches, context)
        if res is None:  # the last piece: q is the final hidden
            self.hidden[:size].copy_(q)
            return
        if res.data_ptr() != residual.data_ptr():  # the fused norms add into the residual in place
            residual.copy_(res)
        self.queries[:size].view(q.shape).copy_(q)  # q: a strided view into the q/k/v projection

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows [start, end) become padding: token 0 at position 0 in the scratch block, no adapter."""
        longs = self.inputs.longs.device
        longs[:2, start:end] = 0
        longs[2, start:end] = self.pad_slot
        self.inputs.token_slots.device[start:end] = NO_LORA
