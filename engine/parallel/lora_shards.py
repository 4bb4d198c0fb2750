"""Adapters on sharded projections, as vLLM splits them (its default, not "fully sharded" LoRA):

- column-parallel q/k/v, gate/up: A [r, in] whole on every rank, B [out, r] split by output like the
  weight, so each rank adds the LoRA update of exactly the output rows it computes (a fused qkv_proj or
  gate_up_proj target, Phi-3's, keeps each part's rows: this rank's q rows, then its k and v rows);
- row-parallel o, down: A [r, in] split by input like the weight, B [out, r] whole; each rank's update
  (x_r A_r^T) B^T is a partial sum that the projection's own all-reduce completes (RowParallelLinear in
  engine/model/layers/linear.py).
- DoRA's magnitudes follow the output rows, as B does; each rank scales its own partial sums by the
  whole row's scale, which the all-reduce then sums (engine/lora/dora.py makes the scales).
- An adapter's own embedding and LM head (engine/lora/vocab.py: modules_to_save, or LoRA on them merged
  whole or kept as factors) follow the vocabulary split of the base's (engine/model/layers/embedding.py):
  each rank holds rows [start, end) of its `plan.vocab_range`, whole matrices cut by rows, LoRA factors
  by the rows of `left` with `right` whole (each rank merges them with its own shard of the base). The
  embedding's masked all-reduce and the head's logits all-gather then assemble exactly tp 1's rows.
  Being vocabulary-sized, the workers' rows do not ride in the step's header: rank 0 broadcasts them
  over the process group right after it, in chunks staged on its device (engine/parallel/rank.py).

The CPU tier keeps whole adapters (validated against the whole model); a slot on a rank holds its shard.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from adapter_format.model_shape import EXPERT_MODULES
from engine.lora.pool import LoRAPool
from engine.lora.slots import SlotImage, SlotLayout
from engine.lora.vocab import rank_parts
from engine.parallel.messages import tensor_bytes
from engine.parallel.plan import ROW_PARALLEL, ShardPlan


def _expert_shard(module: str, a, b, plan: ShardPlan, rank: int):
    """A routed experts' pairs on one rank: this rank's experts (expert parallelism), or every expert's
    slice of intermediate rows: gate/up's B rows of both parts, down's A columns (as the weights)."""
    first, last = plan.expert_range(rank)
    a, b = a[:, :, first:last], b[:, :, first:last]
    start, end = plan.expert_rows(rank)
    inter = plan.shape.moe_intermediate_size
    if module == "experts.down_proj":
        return a[..., start:end], b
    return a, torch.cat([b[..., start:end, :], b[..., inter + start : inter + end, :]], dim=-2)


def shard_image(image: SlotImage, local: SlotLayout, plan: ShardPlan, rank: int) -> SlotImage:
    """Rank `rank`'s shard of a whole adapter image, as a new contiguous image of layout `local`."""
    shard = SlotImage(local, torch.zeros(local.numel, dtype=image.weights.dtype), image.table.clone())
    for module in local.targets:
        a = image.page_a[module]  # [num_layers, max_pages, PAGE_RANK, in]
        b = image.page_b[module]  # [num_layers, max_pages, out, PAGE_RANK]
        if module in EXPERT_MODULES:  # [num_layers, max_pages, E, ...]: as the experts are cut
            a, b = _expert_shard(module, a, b, plan, rank)
        elif module in ROW_PARALLEL:
            start, end = plan.input_range(module, rank)
            a = a[..., start:end]
        else:
            b = torch.cat([b[:, :, start:end] for start, end in plan.output_ranges(module, rank)], dim=2)
        shard.page_a[module].copy_(a)
        shard.page_b[module].copy_(b)
        if module in EXPERT_MODULES:  # DoRA is refused on expert weights: no magnitudes to cut
            continue
        # DoRA's magnitudes follow the output rows: whole for row-parallel projections, cut like B else.
        whole_start, _ = image.layout.output_columns[module]
        start, end = local.output_columns[module]
        ranges = [(0, end - start)] if module in ROW_PARALLEL else plan.output_ranges(module, rank)
        shard.magnitudes[:, start:end] = torch.cat(
            [image.magnitudes[:, whole_start + a : whole_start + b] for a, b in ranges], dim=1
        )
    return shard


def vocab_shard(image: SlotImage, plan: ShardPlan, rank: int) -> list[tuple[torch.Tensor, ...]]:
    """Rank `rank`'s vocabulary rows of an adapter's own embedding and head (vocab.rank_parts), copied
    out of the image (its CPU-tier row may be refilled before the next step sends them)."""
    parts = rank_parts(image.vocab, image.vocab_table, *plan.vocab_range(rank))
    return [tuple(t.clone() for t in part) for part in parts]


class PendingLoad(NamedTuple):
    """A slot rank 0 filled since the last step, and what each worker (rank 1, 2, ...) copies into it."""

    slot: int
    pages: list[int]
    shards: list[SlotImage]
    vocab_table: bytes  # the image's vocab table raw (b"": the adapter owns no embedding or head)
    vocab: list[list[tuple[torch.Tensor, ...]]]  # per worker, vocab_shard (sent by broadcast)


class RankZeroLoRASlots(LoRAPool):
    """Rank 0's adapter pool: the adapter manager sees the whole model's `layout` (its CPU tier holds
    whole adapters); the device pages hold rank 0's shard (`local_layout`: the same pages, slots and
    page tables on every rank, each page smaller). Each load also cuts the workers' shards (pages, and
    vocabulary rows of an adapter's own embedding and head), which `take_pending` hands to the next
    step's message."""

    def __init__(
        self,
        plan: ShardPlan,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        rank_budget: int | None,
        vocab_slots: int = 0,
    ):
        super().__init__(plan.local_shape, max_loras, max_rank, dtype, device, rank_budget, vocab_slots)
        self.plan = plan
        self.local_layout = self.layout
        self.layout = SlotLayout(plan.shape, max_rank)
        self.shape = plan.shape
        self._pending: list[PendingLoad] = []

    def load(self, slot: int, image: SlotImage, pages: list[int]) -> None:
        # Cut now: the CPU-tier row the image lives in may be refilled once this call returns.
        shards = [shard_image(image, self.local_layout, self.plan, r) for r in range(self.plan.world_size)]
        # rank 0 takes its vocabulary rows from the image's room (tracked like the tp 1 copy out of a row)
        shards[0].vocab, shards[0].vocab_table = image.vocab, image.vocab_table
        super().load(slot, shards[0], pages)
        table, vocab = b"", []
        if self.vocab is not None and image.owns_vocab:
            table = tensor_bytes(image.vocab_table)
            vocab = [vocab_shard(image, self.plan, r) for r in range(1, self.plan.world_size)]
        self._pending.append(PendingLoad(slot, list(pages), shards[1:], table, vocab))

    def take_pending(self) -> list[PendingLoad]:
        pending, self._pending = self._pending, []
        return pending
