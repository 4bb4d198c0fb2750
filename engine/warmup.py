"""Start-up warm-up: every Triton kernel variant a step can launch is compiled before the engine serves.

CUDA-graph capture already compiles what decode steps run (one batch per bucket, with and without LoRA),
and so do the captures of speculative verification graphs (spec_decode/verify_graphs.py) and of the
piecewise graphs of steps with prefill tokens (engine/piecewise_graphs.py). This covers the rest: prefill
and mixed prefill/decode steps run eagerly (too large for the pieces, or on engines without them; the
pieces' eager attention kernels too), and, without graphs, decode steps. Per step, what Triton compiles depends on
- the LoRA kernels' launch configs (gathered or segmented path, tile height, split-K), which
  `lora_kernels.tiles.launch_configs` derives from the step's token count, and the kernel ranks the step
  is sized to (one of the pool's rank-bucket variants, engine/lora/pool.py);
- the attention kernel's decode or prefill variant, and for eager decode its key splits
  (`decode_num_splits`, from the batch size);
and on nothing else: the int arguments that change every step (sequence counts, block-table strides, h
strides) are not specialised on. So the plan asks those same functions for every token count a step may
have and keeps one count per distinct answer, then runs one synthetic step at each through the runner's
own `execute`, with an adapter on some tokens, and once without LoRA; the sampler runs each of its paths.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.lora.slots import lora_launches
from engine.model.paged_attention_triton import decode_num_splits
from engine.request import NO_LORA, Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest
from lora_kernels import tiles

logger = logging.getLogger(__name__)

# Sampling settings whose paths differ in the sampler: greedy, top-k/top-p, seeded, logprobs, min_tokens.
WARMUP_PARAMS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.7, min_tokens=4, stop_token_ids=[0]),
)


def lora_groups(shape) -> list[tuple[int, int]]:
    """(num_slices, in_features) of each LoRA launch in a layer: q/k/v, o, gate/up, down (one slice
    each where the checkpoint fuses them, as Phi-3's qkv_proj and gate_up_proj)."""
    return [(len(group), shape.module_dims(group[0])[0]) for group in lora_launches(shape.targets)]


def lora_key(num_tokens: int, groups, num_slots: int, max_rank: int, dtype, device) -> tuple:
    """What the LoRA kernels of a step of `num_tokens` tokens compile (equal keys: no new variant)."""
    path = tiles.choose_path(num_tokens)
    return tuple(
        tiles.launch_configs(path, num_tokens, num_slots, slices, in_features, max_rank, dtype, device)
        for slices, in_features in groups
    )


def eager_token_counts(max_tokens: int, key, first: int = 2) -> list[int]:
    """The smallest token count in [first, max_tokens] of each distinct `key(num_tokens)`."""
    seen: dict = {}
    for num_tokens in range(first, max_tokens + 1):
        seen.setdefault(key(num_tokens), num_tokens)
    return sorted(seen.values())


def decode_batch_sizes(max_num_seqs: int, key, num_kv_heads: int, device) -> list[int]:
    """Eager decode (no graphs): the smallest batch size of each distinct (key splits, LoRA key)."""
    seen: dict = {}
    for size in range(1, max_num_seqs + 1):
        seen.setdefault((decode_num_splits(size, num_kv_heads, device), key(size)), size)
    return sorted(seen.values())


class WarmupBatches:
    """Synthetic steps over the real KV cache (its contents are overwritten before any request reads them)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.num_blocks = runner.num_kv_blocks
        self.max_model_len = runner.max_model_len
        self.max_num_seqs = runner.config.max_num_seqs
        self._next_id = 0

    def mixed(self, num_tokens: int, use_lora: bool) -> list[ScheduledRequest]:
        """One decode row of a two-block context (when the chunks leave room for it), then prefill chunks:
        `num_tokens` tokens in all (fewer if max_num_seqs sequences cannot hold them). LoRA, when used, on
        the chunks only."""
        longest_chunk = self.max_model_len - 1
        batch, left = [], num_tokens
        if 1 < num_tokens <= 1 + (self.max_num_seqs - 1) * longest_chunk:
            context = max(1, min(2 * self.block_size, longest_chunk))
            batch.append(self._scheduled(context, context - 1, NO_LORA))
            left -= 1
        while left > 0 and len(batch) < self.max_num_seqs:
            chunk = min(left, longest_chunk)
            batch.append(self._scheduled(chunk, 0, 0 if use_lora else NO_LORA))
            left -= chunk
        return batch

    def decode(self, num_seqs: int, use_lora: bool) -> list[ScheduledRequest]:
        """`num_seqs` sequences adding one token each, every other one with an adapter."""
        context = max(1, min(self.block_size + 1, self.max_model_len - 1))
        slots = [0 if use_lora and i % 2 == 0 else NO_LORA for i in range(num_seqs)]
        return [self._scheduled(context, context - 1, slot) for slot in slots]

    def _scheduled(self, num_tokens: int, start: int, lora_slot: int) -> ScheduledRequest:
        request = Request(f"warmup-{self._next_id}", [0] * num_tokens, SamplingParams())
        self._next_id += 1
        request.lora_slot = lora_slot
        num_blocks = -(-num_tokens // self.block_size)
        blocks = [i % self.num_blocks for i in range(num_blocks)]
        return ScheduledRequest(request, num_tokens - start, start, blocks)


def warm_up(runner, sampler) -> None:  # sampler: the engine's, for its type only
    """Compile every variant before serving; logs the time it took and the compiles it caused."""
    from engine import kernel_compiles

    counter = kernel_compiles.install()
    compiles_before, started = counter.num_compiles, time.perf_counter()
    config = runner.config
    # The kernels see this rank's projection sizes (tensor parallelism shards o's and down's inputs).
    shape = runner.shape if runner.parallel is None else runner.parallel.plan.local_shape
    groups = lora_groups(shape)

    pool = runner.lora_slots
    # The kernel ranks a step's LoRA kernels may be sized to (engine/lora/pool.py, rank buckets); each
    # one compiles its own variants. Under tensor parallelism, only the pool's kernel rank.
    variants = pool.bucket_variants() if runner.parallel is None else [(pool.kernel_rank,)]
    # A mixture of experts' kernels compile per rows-per-block too (engine/model/moe_kernels.py).
    moe_key = getattr(runner.model, "kernel_key", None)

    def key(num_tokens: int) -> tuple:
        lora = tuple(
            lora_key(num_tokens, groups, pool.max_loras, rank, runner.dtype, runner.device)
            for variant in variants
            for rank in variant
        )
        return lora if moe_key is None else (lora, moe_key(num_tokens))

    batches = WarmupBatches(runner)
    max_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * (runner.max_model_len - 1))
    counts = eager_token_counts(max_tokens, key)
    lora_steps = [batches.mixed(n, use_lora=True) for n in counts]
    steps = [batches.mixed(max_tokens, use_lora=False)]
    if moe_key is not None:  # the fused-MoE kernels without LoRA's deltas, at every rows-per-block
        steps += [batches.mixed(n, use_lora=False) for n in counts]
    if runner.graphs is None:
        sizes = decode_batch_sizes(config.max_num_seqs, key, runner.model.num_kv_heads, runner.device)
        lora_steps += [batches.decode(n, use_lora=True) for n in sizes]
        steps.append(batches.decode(1, use_lora=False))
        if moe_key is not None:
            steps += [batches.decode(n, use_lora=False) for n in sizes]
    # Eager variants only: steps a verification graph or the piecewise graphs could serve must run
    # eagerly here too, since steps too large for their buckets run them so later (capture compiled theirs).
    verify_graphs, runner.verify_graphs = runner.verify_graphs, None
    pieces, runner.pieces = runner.pieces, None
    try:
        for variant in variants:
            runner.warm_up_rank_buckets = variant
            for scheduled in lora_steps:
                logits = runner.execute(scheduled)
        runner.warm_up_rank_buckets = None
        for scheduled in steps:
            logits = runner.execute(scheduled)
    finally:
        runner.verify_graphs = verify_graphs
        runner.pieces = pieces
        runner.warm_up_rank_buckets = None
    runner.reset_inputs()
    warm_up_sampler(type(sampler)(), logits)  # a sampler of its own: the engine's random state stays put
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info(
        "warm-up: %d synthetic steps (token counts %s, LoRA ranks %s) in %.1f s; %d Triton kernel variants "
        "compiled (%.1f s compiling in this process)",
        len(steps) + len(lora_steps) * len(variants),
        counts,
        variants,
        time.perf_counter() - started,
        counter.num_compiles - compiles_before,
        counter.compile_seconds,
    )


def warm_up_sampler(sampler, logits: torch.Tensor) -> None:
    """Each sampling path once on real logits (its first CUDA uses allocate workspaces)."""
    rows = torch.arange(len(WARMUP_PARAMS), device=logits.device) % logits.shape[0]
    logits = logits[rows]
    requests = []
    for i in range(logits.shape[0]):
        params = WARMUP_PARAMS[i % len(WARMUP_PARAMS)]
        requests.append(Request(f"warmup-sampler-{i}", [0], params, eos_token_id=0))
    sampler(logits, requests)
