"""The only part of the engine that touches tensors: loads the model, owns the KV cache and the adapter
slots, turns a scheduled batch into model inputs and returns the logits of the rows that sample."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeCudaGraphs, graphs_wanted
from engine.input_batch import InputBatch
from engine.lora.context import LoRAContext
from engine.lora.dora import DoraBase
from engine.lora.kv_tier import staging_words
from engine.lora.pool import LoRAPool
from engine.lora.slots import PAGE_RANK
from engine.lora.vocab import VocabSlots
from engine.model.attention import AttentionMetadata
from engine.model.kv_quant import FP8_DTYPE
from engine.model.loader import checkpoint_dtype, load_model
from engine.model.paged_attention_triton import interpreting
from engine.model.registry import model_shape
from engine.piecewise_graphs import PiecewiseCudaGraphs, piecewise_unsupported
from engine.prompt_logprobs import (
    PromptTokenLogprobs,
    compute_prompt_logprobs,
    prompt_logprob_rows,
    wants_prompt_logprobs,
)
from engine.request import Request
from engine.sampler import SampledStep
from engine.scheduler_output import ScheduledRequest
from engine.spec_decode.verify_graphs import VerifyCudaGraphs

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config, max_model_len: int, parallel=None):
        """`parallel`: this rank's TensorParallelRank (engine/parallel/rank.py) in a worker; rank 0 starts
        its own when tensor_parallel_size > 1. None for tensor_parallel_size 1, which runs no collective."""
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype(checkpoint_dtype(hf_config))
        self.kv_cache_dtype = config.kv_cache_torch_dtype(self.dtype)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.attention_backend = config.resolved_attention_backend
        if self.attention_backend == "triton" and self.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"attention_backend 'triton' needs a CUDA device (got {self.device}); use 'auto' or 'torch'"
            )
        if (
            self.kv_cache_dtype == FP8_DTYPE
            and self.attention_backend == "triton"
            and self.device.type == "cuda"
        ):
            _check_fp8_triton_support(self.device)
        if parallel is None and config.tensor_parallel_size > 1:
            from engine.parallel.rank import TensorParallelRank

            parallel = TensorParallelRank.start(config, model_path, hf_config, max_model_len)
        self.parallel = parallel
        self.shape = model_shape(hf_config)
        if parallel is None:
            self.model = load_model(
                model_path,
                hf_config,
                self.dtype,
                self.device,
                max_model_len,
                self.attention_backend,
                config.quantization,
                config.fp8_gemm,
                load_format=config.load_format,
            )
            # Allocated before the KV cache is sized, so the adapter pool counts in gpu_memory_utilization.
            self.lora_slots = LoRAPool(
                self.shape,
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
                config.lora_pool_rank_budget,
                config.max_vocab_loras,
            )
            self.lora_slots.dora_base = DoraBase(self.model, self.lora_slots.layout)
        else:
            self.model, self.lora_slots = parallel.build(
                config, model_path, hf_config, self.dtype, max_model_len, self.attention_backend
            )
        if config.max_vocab_loras:  # this rank's vocabulary rows of them (the whole vocabulary at tp 1)
            self.lora_slots.vocab = VocabSlots(
                self.model, config.max_vocab_loras, config.max_loras, self.dtype, self.device
            )
        # The KV tier's staging buffer (engine/lora/kv_tier.py): one max-rank adapter, allocated before the
        # KV cache is sized, so it counts in gpu_memory_utilization.
        self.kv_tier_staging: torch.Tensor | None = None
        if config.enable_adapter_kv_cache and parallel is None:
            word, words = staging_words(self.lora_slots, self.kv_block_bytes, 2 * self.model.num_layers)
            self.kv_tier_staging = torch.empty(words, dtype=word, device=self.device)
        elif config.enable_adapter_kv_cache and parallel.rank == 0:
            logger.info("the adapter KV tier is off under tensor parallelism (each rank would keep a shard)")
        self.num_kv_blocks = config.num_kv_blocks or self._profile_num_kv_blocks()
        if parallel is not None:  # every rank's cache holds the same blocks (its own heads of them)
            self.num_kv_blocks = parallel.group.min(self.num_kv_blocks)
        # One block more than the scheduler knows of: CUDA-graph padding rows write their K/V there.
        self.pad_block = self.num_kv_blocks
        self.kv_storage = self._allocate_kv_storage(self.num_kv_blocks + 1)
        self.kv_caches = _layer_views(self.kv_storage)
        self.inputs = InputBatch(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            -(-max_model_len // self.block_size),
            self.block_size,
            self.pad_block,
            self.device,
        )
        self.warm_up_rank_buckets: tuple[int, ...] | None = None  # engine/warmup.py sets it
        # The last step's new prompt logprob entries, per request that asked (engine/prompt_logprobs.py).
        self.prompt_logprobs: dict[Request, list[PromptTokenLogprobs]] = {}
        self.graphs: DecodeCudaGraphs | None = None
        if graphs_wanted(config):
            self.graphs = DecodeCudaGraphs(
                self.model,
                self.kv_caches,
                self.lora_slots,
                self.inputs.decode,
                config.max_num_seqs,
                self.pad_block,
                self.block_size,
                self.device,
                self.lora_slots.bucket_variants() if parallel is None else None,
            )
            self.graphs.capture()
        self.verify_graphs = self._capture_verify_graphs()
        self.pieces = self._capture_pieces(parallel)
        if parallel is not None:  # the shutdown sequence drops them before the communicator they captured
            parallel.hold(self.graphs, self.verify_graphs)
        self.closed = False
        logger.info(
            "model loaded: %d layers, %s on %s; LoRA pool %.0f MiB (%d pages of %d rank rows); "
            "KV cache %d blocks of %d tokens, %s; attention %s, %s",
            self.model.num_layers,
            self.dtype,
            self.device,
            self.lora_slots.num_bytes / 2**20,
            self.lora_slots.num_pages,
            PAGE_RANK,
            self.num_kv_blocks,
            self.block_size,
            self._kv_cache_description(self.model),
            self.attention_backend,
            _graphs_description(self.graphs, self.verify_graphs),
        )

    def _capture_verify_graphs(self) -> VerifyCudaGraphs | None:
        """Graphs for speculative verification steps, only with speculation and decode graphs on (every
        rank captures them, as the decode graphs; a worker builds them from the same config, so it holds
        the same buckets as rank 0 whether or not rank 0 speculates)."""
        spec = self.config.speculative_config
        if self.graphs is None or spec is None or not spec.cuda_graphs:
            return None
        graphs = VerifyCudaGraphs(self, spec.num_speculative_tokens, spec.disable_by_batch_size)
        if not graphs.buckets:
            return None
        graphs.capture(self.graphs.pool)
        return graphs

    def _capture_pieces(self, parallel) -> PiecewiseCudaGraphs | None:
        """Piecewise graphs for steps holding prefill tokens, where the decode graphs are on and
        piecewise_unsupported allows (engine/piecewise_graphs.py)."""
        if self.graphs is None:
            return None
        reason = piecewise_unsupported(self.config, self.model, parallel)
        if reason is not None:
            logger.info("mixed prefill/decode steps run eagerly: %s", reason)
            return None
        pieces = None
        try:
            pieces = PiecewiseCudaGraphs(
                self.model,
                self.kv_caches,
                self.lora_slots,
                self.inputs.eager,
                self.config.max_num_batched_tokens,
                self.pad_block * self.block_size,
                self.device,
            )
            pieces.capture(self.graphs.pool)
            return pieces
        except Exception as exc:  # serve, eagerly, rather than not start (the GPU tests count replays)
            error = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "piecewise CUDA graphs could not be captured (%s); mixed prefill/decode steps run eagerly", error
        )
        del pieces  # (after the except block: its traceback held the half-captured graphs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return None

    @property
    def kv_block_bytes(self) -> int:
        """K and V of one block over all layers, in the cache dtype (fp8: 1 byte an element)."""
        m = self.model
        element = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * element

    def _kv_cache_description(self, model) -> str:
        if self.kv_cache_dtype != FP8_DTYPE:
            return f"dtype {self.kv_cache_dtype}"
        source = "from the checkpoint" if model.kv_scales_from_checkpoint else "1.0: none in the checkpoint"
        return f"dtype {self.kv_cache_dtype} (fp8, per-tensor scales {source})"

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], in_flight: SampledStep | None = None
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [num_sampling_rows, vocab], rows in `scheduled` order
        of the requests whose `samples` is true. Input tokens the host does not know yet (async
        scheduling) are read from `in_flight`, the previous step's sampling, on the device. Prompt logprob
        entries the step computed are left in `self.prompt_logprobs`."""
        if self.closed:
            raise RuntimeError("the engine was shut down")
        self.inputs.update(scheduled)
        self.prompt_logprobs = {}
        # needs every row's hidden state: eager
        wants_prompt = wants_prompt_logprobs(scheduled)
        # Adapters that own an embedding or LM head (engine/lora/vocab.py): their path has static shapes,
        # so the decode and verification graphs capture it with the LoRA kernels.
        vocab = self.lora_slots.vocab
        if (
            self.graphs is not None
            and not wants_prompt
            and _is_decode_only(scheduled, self.graphs.max_batch_size)
        ):
            size = self.graphs.bucket(len(scheduled))
            use_lora = self.inputs.prepare_decode(scheduled, size, in_flight)
            if self.parallel is not None:
                self.parallel.send_graph(self.inputs.decode, len(scheduled), size, use_lora)
            buckets = self.rank_buckets(len(scheduled)) if use_lora else None
            logits = self.graphs.replay(len(scheduled), size, use_lora, buckets)
            if all(s.samples for s in scheduled):
                return logits
            rows = [i for i, s in enumerate(scheduled) if s.samples]
            return logits[torch.tensor(rows, device=logits.device)]
        if self.verify_graphs is not None and not wants_prompt and self.verify_graphs.fits(scheduled):
            return self.verify_graphs.execute(self.inputs, scheduled, in_flight, self.parallel)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        size = self.pieces.bucket(num_tokens) if self.pieces is not None else None
        input_ids, meta, token_slots, logits_rows = self.inputs.prepare_eager(scheduled, in_flight, size)
        if self.parallel is not None:
            prompt_rows = None
            if wants_prompt:
                prompt_rows = torch.tensor(prompt_logprob_rows(scheduled), device=self.device)
            self.parallel.send_eager(input_ids, meta, token_slots, logits_rows, prompt_rows)
        lora = None
        # the pieces hold the LoRA path: a context here serves only adapters' own heads, if any
        if token_slots is not None and (size is None or vocab is not None):
            buckets = self.rank_buckets(len(scheduled))
            # the vocab path whenever the pool has vocab slots: the code the decode graphs capture
            lora = LoRAContext(self.lora_slots, token_slots, buckets, vocab=vocab is not None)
        if size is not None:  # everything but attention replayed
            hidden = self.pieces.run(num_tokens, size, meta, token_slots is not None)
        else:
            hidden = self.model.forward(input_ids, meta, self.kv_caches, lora)

        def compute_logits(rows) -> torch.Tensor:  # hidden rows -> logits, adapters' own heads included
            rows = torch.as_tensor(rows, device=hidden.device)
            own = lora.own_heads(rows) if lora is not None and lora.vocab else None
            return self.model.compute_logits(hidden[rows], own)

        if wants_prompt:
            vocab_size = self.model.vocab_size
            self.prompt_logprobs = compute_prompt_logprobs(
                compute_logits, vocab_size, scheduled, hidden.device
            )
        return compute_logits(logits_rows)

    def step_guard(self):
        """Wraps one engine step: under tensor parallelism the watchdog times it, and a step that a
        worker's death or hang cut short raises TensorParallelError instead of returning outputs."""
        return self.parallel.step_guard() if self.parallel is not None else nullcontext()

    @property
    def num_graph_replays(self) -> tuple[int, int, int]:
        """(decode, verification, piecewise) steps served by CUDA-graph replays since start-up (warm-up
        excluded); piecewise: steps with prefill tokens (engine/piecewise_graphs.py)."""
        decode = self.graphs.num_replays if self.graphs is not None else 0
        verify = self.verify_graphs.num_replays if self.verify_graphs is not None else 0
        pieces = self.pieces.num_replays if self.pieces is not None else 0
        return decode, verify, pieces

    def rank_buckets(self, num_rows: int) -> tuple[int, ...] | None:
        """The kernel ranks this step's LoRA kernels are sized to: the rank buckets of the adapters its
        rows use (LoRAPool.step_buckets). None under tensor parallelism (the pool's kernel rank, as the
        workers run), and the warm-up's choice while it sets `warm_up_rank_buckets`."""
        if self.parallel is not None:
            return None
        if self.warm_up_rank_buckets is not None:
            return self.warm_up_rank_buckets
        slots = self.inputs.lora_slots[:num_rows]
        return self.lora_slots.step_buckets(np.unique(slots[slots >= 0]))

    def shutdown(self) -> None:
        """Free the model, the KV cache, the adapter pool and the graphs now (the runner cannot run a step
        after it), and stop the tensor-parallel workers, if any, with rank 0 leaving the process group,
        so another engine may start in this process. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.parallel is None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (under tensor parallelism: bounded, in the sequence)
        self.graphs = self.verify_graphs = self.pieces = None
        self.model = self.kv_caches = self.kv_storage = self.kv_tier_staging = self.inputs = None
        self.lora_slots = None
        if self.parallel is not None:
            self.parallel.shutdown()  # drops what it held, stops the workers, leaves the group
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset_inputs(self) -> None:
        """Drop the input rows of earlier steps (the warm-up's synthetic requests)."""
        self.inputs.reset()

    def _allocate_kv_storage(self, num_blocks: int) -> torch.Tensor:
        """[2 * num_layers, num_blocks, block_size, kv_heads, head_dim]: every layer's K and V in one tensor,
        so the KV tier (engine/lora/kv_tier.py) moves a block of all of them in one copy."""
        m = self.model
        shape = (2 * m.num_layers, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def _profile_num_kv_blocks(self) -> int:
        """Blocks that fit the memory budget: on CUDA what gpu_memory_utilization leaves after the weights
        and a dummy step of max_num_batched_tokens; on the CPU cpu_kv_cache_bytes. Never more than
        max_num_seqs full-length sequences need, unless kv_cache_whole_budget (on CUDA, with no draft
        model, whose cache mirrors every block): then the blocks no request can use hold adapters (the
        KV tier) and prefixes."""
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type != "cuda":
            return max(2, min(useful, self.config.cpu_kv_cache_bytes // self.kv_block_bytes))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_step()
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory held by other processes counts against the budget too.
        others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - others
        blocks = budget // self.kv_block_bytes
        if blocks < 2:
            raise ValueError(
                f"no room for the KV cache: the weights and a step of {self.config.max_num_batched_tokens} "
                f"tokens use {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise gpu_memory_utilization "
                "or lower max_num_batched_tokens"
            )
        if self.config.kv_cache_whole_budget and self.config.speculative_config is None:
            return blocks
        return min(useful, blocks)

    def _dummy_step(self) -> None:
        """One forward of the largest batch the scheduler may send, to measure activation memory."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        caches = _layer_views(self._allocate_kv_storage(num_blocks))
        meta = AttentionMetadata(
            positions=torch.arange(num_tokens, device=self.device),
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(num_blocks, device=self.device)[None, :],
            query_start_loc=[0, num_tokens],
            seq_lens=[num_tokens],
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        slots = torch.zeros(num_tokens, dtype=torch.int32, device=self.device)
        with torch.inference_mode():  # the vocab path too, when there are vocab slots (its scratch counts)
            lora = LoRAContext(self.lora_slots, slots, vocab=self.lora_slots.vocab is not None)
            hidden = self.model.forward(ids, meta, caches, lora)
            rows = min(self.config.max_num_seqs, num_tokens)
            self.model.compute_logits(
                hidden[:rows], lora.own_heads(torch.arange(rows, device=self.device)) if lora.vocab else None
            )
        del caches, hidden
        torch.cuda.synchronize(self.device)


def _layer_views(storage: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) caches [num_blocks, block_size, kv_heads, head_dim]: contiguous views."""
    return [(storage[2 * i], storage[2 * i + 1]) for i in range(storage.shape[0] // 2)]


def _check_fp8_triton_support(device: torch.device) -> None:
    """Triton reads float8 e4m3 (its fp8e4nv) on compute capability 8.9+ only (Ada, Hopper and later)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype fp8 with the Triton attention backend needs compute capability 8.9 or newer "
            f"(this GPU is {major}.{minor}); use kv_cache_dtype 'auto', or attention_backend 'torch'"
        )


def _graphs_description(graphs, verify_graphs) -> str:
    if graphs is None:
        return "eager"
    if verify_graphs is None:
        return "CUDA graphs for decode"
    return f"CUDA graphs for decode and verification (lanes of {verify_graphs.lane} tokens)"


def _is_decode_only(scheduled: list[ScheduledRequest], max_batch_size: int) -> bool:
    """One new token per sequence (decodes, or 1-token prefill chunks) in a batch a graph can hold."""
    return len(scheduled) <= max_batch_size and all(s.num_new_tokens == 1 for s in scheduled)
