"""The GPU adapter pool: adapter weights in pages of rank rows, so each adapter takes what its rank needs.

`max_loras` slots say which adapters are resident (the kernels index per-slot scales, ranks and page
tables by a token's slot); the memory is `num_pages` pages (engine/lora/slots.py lays a page out), by
default enough for max_loras adapters at max_lora_rank. With a smaller `rank_budget`, many small
adapters share what few large ones would take: an adapter of rank r holds ceil(r / PAGE_RANK) pages.
Which pages an adapter holds is the allocator's business (engine/lora/slot_allocator.py); this class
owns the tensors, which the model reads directly (`lora_kernels.add_lora_paged`), so loading never
reallocates anything the model holds, and CUDA graphs replay over the same buffers.

Layout on the device, e.g. max_loras = 3, max_lora_rank = 64 (8 pages), rank_budget = 96 (12 pages),
adapters of rank 16 (slot 0), 64 (slot 1) and 8 (slot 2):

    weights     [num_pages, page_numel]   pages 0-1: slot 0, 2-9: slot 1, 10: slot 2, 11: free
    page_table  [max_loras, max_pages]    row 0 = [0, 1, ...], row 1 = [2..9], row 2 = [10, ...]
    table       [num_layers, table_columns, max_loras]  scales and ranks per layer and slot, DoRA flags
    dora_scales [num_layers, max_loras, output_width]  float32: DoRA's magnitude / ||W + s B A|| per
                output row of every target (read only for slots whose DoRA flag is set)

(past an adapter's pages its page-table row holds stale ids: the kernels may load them, with the rest
of the row, but never address weights through them, since they stop at the adapter's rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from adapter_format.checkpoint import PeftAdapter
from adapter_format.model_shape import ModelShape
from engine.lora.pages import pages_for_rank, runs
from engine.lora.slots import PAGE_RANK, SlotImage, SlotLayout, build_image

# The smallest kernel rank a step is sized to: the kernels' rank tile is at least 16 wide anyway
# (lora_kernels.tiles.block_r), so ranks 1 to 16 cost the same.
RANK_BUCKET_BASE = 16


def kernel_rank_buckets(kernel_rank: int) -> tuple[int, ...]:
    """The kernel ranks a step may be sized to: 16, then times 4 up to the pool's kernel rank (itself
    last). 64 -> (16, 64); 128 -> (16, 64, 128); 16 -> (16,)."""
    buckets = [min(RANK_BUCKET_BASE, kernel_rank)]
    while buckets[-1] < kernel_rank:
        buckets.append(min(4 * buckets[-1], kernel_rank))
    return tuple(buckets)


@dataclass(frozen=True)
class LaunchArgs:
    """One launch group's pool tensors in one layer, as lora_kernels.ops.plan_paged / run_paged take them."""

    pool_as: list[torch.Tensor]  # per projection: [num_pages, PAGE_RANK, in]
    pool_bs: list[torch.Tensor]  # per projection: [num_pages, out, PAGE_RANK]
    scales: list[torch.Tensor]  # per projection: [max_loras] float32
    output_slices: list[int]  # per projection: its output width
    slot_ranks: torch.Tensor  # [max_loras] int32: the group's largest rank per slot
    dora_scales: torch.Tensor  # [max_loras, sum of outputs] float32
    dora_slots: torch.Tensor  # [max_loras] int32


@dataclass
class ModuleSlots:
    """One projection of one layer (views into `LoRAPool`'s tensors)."""

    lora_a: torch.Tensor  # [num_pages, PAGE_RANK, in], page stride page_numel ([num_pages, E, ...]: experts)
    lora_b: torch.Tensor  # [num_pages, out, PAGE_RANK], likewise
    scales: torch.Tensor  # [max_loras] float32; 0 where the slot's adapter does not target this module
    ranks: torch.Tensor  # [max_loras] int32; 0 where untargeted


class LoRAPool:
    """Paged adapter weights; `layers[i][module]` is that projection's ModuleSlots for layer i."""

    def __init__(
        self,
        shape: ModelShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        rank_budget: int | None = None,
        vocab_slots: int = 0,
    ):
        """`vocab_slots`: slots 0 .. vocab_slots - 1 may hold adapters with their own embedding or LM head,
        whose matrices live in `vocab` (engine/lora/vocab.py, attached by the model runner)."""
        self.shape = shape
        self.vocab_slots = min(vocab_slots, max_loras)
        self.vocab = None  # engine.lora.vocab.VocabSlots
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.layout = layout = SlotLayout(shape, max_rank)
        max_pages = self.layout.max_pages
        self.num_pages = (
            max_loras * max_pages if rank_budget is None else pages_for_rank(rank_budget, PAGE_RANK)
        )
        if self.num_pages < max_pages:
            raise ValueError(
                f"a LoRA pool of {self.num_pages * PAGE_RANK} rank rows cannot hold one adapter of "
                f"max_lora_rank {max_rank}; raise lora_pool_rank_budget to at least {max_rank}"
            )
        n = shape.num_layers
        self.weights = torch.zeros(self.num_pages, self.layout.page_numel, dtype=dtype, device=device)
        self.page_table = torch.zeros(max_loras, max_pages, dtype=torch.int32, device=device)
        self.table = torch.zeros(n, layout.table_columns, max_loras, dtype=torch.int32, device=device)
        # DoRA: made per slot when a DoRA adapter is loaded (engine/lora/dora.py); one row per slot and
        # layer, however many adapters are DoRA, so CUDA graphs read the same buffer whatever loads.
        self.dora_scales = torch.ones(n, max_loras, layout.output_width, dtype=torch.float32, device=device)
        self.dora_slots = self.table[:, layout.dora_column]  # [num_layers, max_loras] int32
        self.dora_base = None  # engine.lora.dora.DoraBase, attached by the model runner
        self._dora_views: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}
        self._launch_args: dict[tuple[int, tuple[str, ...]], LaunchArgs] = {}
        self._output_columns = layout.output_columns  # this pool's own (a rank's shard's) widths
        self._page_ids = torch.arange(
            self.num_pages, dtype=torch.int32, device=device
        )  # copied, never synced
        views: dict[tuple[str, str], list[torch.Tensor]] = {}
        for (module, kind), (offset, (_, *dims)) in self.layout.blocks().items():
            size = math.prod(dims)
            views[module, kind] = [
                self.weights[:, offset + i * size : offset + (i + 1) * size].unflatten(1, dims)
                for i in range(n)
            ]
        # module -> [num_layers, max_loras]; each layer's row is contiguous, as the kernels need.
        self.scales = {m: self.table[:, c].view(torch.float32) for m, c in layout.scale_column.items()}
        self.ranks = {m: self.table[:, c] for m, c in layout.rank_column.items()}
        # Per group the model applies at once, the largest rank of its projections per layer and slot:
        # the kernels read no row past it.
        self.rank_bounds: dict[tuple[str, ...], torch.Tensor] = {(m,): self.ranks[m] for m in layout.targets}
        self.rank_bounds.update({g: self.table[:, c] for g, c in layout.bound_column.items()})
        self.layers: list[dict[str, ModuleSlots]] = [
            {
                m: ModuleSlots(views[m, "a"][i], views[m, "b"][i], self.scales[m][i], self.ranks[m][i])
                for m in layout.targets
            }
            for i in range(n)
        ]
        # Rank buckets (lora_kernels.add_lora_paged): per slot, a bit for each bucket its adapter's ranks
        # fall in, so a step's kernels are sized to the ranks of the slots it uses (`step_buckets`).
        self.rank_buckets = kernel_rank_buckets(self.kernel_rank)
        self.slot_buckets = np.zeros(max_loras, np.int64)  # host side, set by `load`

    def launch_args(self, layer: int, modules: tuple[str, ...]) -> LaunchArgs:
        """The pool's side of one launch group's kernel call in `layer` (static views: built once, then
        looked up, so an eager step's 4 x layers calls build no lists)."""
        args = self._launch_args.get((layer, modules))
        if args is None:
            targets = [self.layers[layer][m] for m in modules]
            args = self._launch_args[layer, modules] = LaunchArgs(
                pool_as=[t.lora_a for t in targets],
                pool_bs=[t.lora_b for t in targets],
                scales=[t.scales for t in targets],
                output_slices=[t.lora_b.shape[1] for t in targets],
                slot_ranks=self.slot_ranks(layer, modules),
                dora_scales=self.dora_view(layer, modules),
                dora_slots=self.dora_slots[layer],
            )
        return args

    def dora_view(self, layer: int, modules: tuple[str, ...]) -> torch.Tensor:
        """[max_loras, sum of the modules' outputs]: the DoRA scales of one launch group (its columns are
        contiguous, in y's order; the slot stride is the whole row)."""
        view = self._dora_views.get((layer, modules))
        if view is None:
            columns = self._output_columns
            start, end = columns[modules[0]][0], columns[modules[-1]][1]
            if end - start != sum(columns[m][1] - columns[m][0] for m in modules):
                raise ValueError(f"LoRA targets {modules} are not consecutive in {self.shape.targets}")
            view = self._dora_views[layer, modules] = self.dora_scales[layer, :, start:end]
        return view

    @property
    def kernel_rank(self) -> int:
        """h's width in the kernels: max_lora_rank rounded up to whole pages."""
        return self.layout.max_pages * PAGE_RANK

    @property
    def num_bytes(self) -> int:
        """Device memory the pool holds (weights, page tables, scales and ranks)."""
        tensors = (self.weights, self.page_table, self.table, self.dora_scales)
        vocab = self.vocab.num_bytes if self.vocab is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors) + vocab

    def image(self, adapter: PeftAdapter, pin_memory: bool = False) -> SlotImage:
        """Lay an adapter (validated against this model) out as pool pages, on the CPU."""
        return build_image(self.layout, self.dtype, adapter, pin_memory)

    def load(self, slot: int, image: SlotImage, pages: list[int]) -> None:
        """Copy an adapter's image into `pages` and point `slot` at them (asynchronously on CUDA when the
        image is pinned): one copy per run of consecutive pages, plus the slot's table column."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.max_loras})")
        if len(pages) < image.num_pages:
            raise ValueError(f"the adapter fills {image.num_pages} pages but only {len(pages)} were given")
        source = image.pages
        for start, first, count in runs(list(pages[: image.num_pages])):
            self.weights[first : first + count].copy_(source[start : start + count], non_blocking=True)
            self.page_table[slot, start : start + count].copy_(self._page_ids[first : first + count])
        self.table[:, :, slot].copy_(image.table, non_blocking=True)
        self.slot_buckets[slot] = self.bucket_mask(image)
        if self.vocab is not None:  # its own embedding / head, or none: the slot's old ones are dropped
            self.vocab.load_image(slot, image.vocab, image.vocab_table)
        elif image.owns_vocab:
            raise ValueError("this adapter pool holds no adapter's own embedding or LM head")
        if image.use_dora:
            if self.dora_base is None:
                raise ValueError("this adapter pool serves no DoRA adapters (no base weights attached)")
            self.dora_base.fill_scales(self, slot, image)

    def point(self, slot: int, pages: list[int], table: torch.Tensor, buckets: int) -> None:
        """Point `slot` at `pages` that already hold a plain adapter's weights (the KV tier copied them
        there: engine/lora/kv_tier.py), with its table column [num_layers, table_columns] (on the device)
        and rank buckets; the slot's old own embedding or head, if any, is dropped."""
        for start, first, count in runs(list(pages)):
            self.page_table[slot, start : start + count].copy_(self._page_ids[first : first + count])
        self.table[:, :, slot].copy_(table)
        self.slot_buckets[slot] = buckets
        if self.vocab is not None:
            self.vocab.load(slot, None, None)

    def finish_dora(self) -> None:
        """Tensor parallelism: make the DoRA scales of the slots loaded since the last call (every rank
        calls it at the same point of a step: engine/lora/dora.py)."""
        if self.dora_base is not None:
            self.dora_base.finish(self)

    def bucket_mask(self, image: SlotImage) -> int:
        """Bit i set if some rank the kernels read for this adapter (a projection's, or a fused group's
        largest) lies in bucket i: (rank_buckets[i - 1], rank_buckets[i]]."""
        ranks = np.unique(image.table[:, image.layout.rank_columns.start :].numpy())
        indices = np.searchsorted(np.asarray(self.rank_buckets), ranks[ranks > 0])
        return int(np.bitwise_or.reduce(np.left_shift(1, indices), initial=0))

    def step_buckets(self, slots: np.ndarray) -> tuple[int, ...]:
        """The kernel ranks of a step whose tokens use `slots` (>= 0): the one bucket they all fall in,
        else every bucket (one launch pair each; a bucket no token falls in costs only an empty launch).
        One of `bucket_variants()`, which the decode graphs are captured for."""
        mask = int(np.bitwise_or.reduce(self.slot_buckets[slots], initial=0)) if len(slots) else 0
        if mask and mask & (mask - 1) == 0:  # a single bit
            return (self.rank_buckets[mask.bit_length() - 1],)
        return self.rank_buckets

    def bucket_variants(self) -> list[tuple[int, ...]]:
        """Every `step_buckets` answer: each bucket alone, then all of them."""
        variants = [(b,) for b in self.rank_buckets]
        return variants if len(variants) == 1 else [*variants, self.rank_buckets]

    def snapshot(self, slot: int) -> SlotImage:
        """What `slot` holds, gathered into a new CPU image (tests and debugging; it syncs)."""
        table = self.table[:, :, slot].cpu()
        num_pages = pages_for_rank(int(table[:, self.layout.rank_columns.start :].max()), PAGE_RANK)
        image = SlotImage(self.layout, torch.zeros(self.layout.numel, dtype=self.dtype), table.contiguous())
        pages = self.page_table[slot, :num_pages].long()
        image.pages[:num_pages] = self.weights[pages].cpu()
        return image  # its magnitudes are zeros: the pool keeps DoRA's scales, not its magnitudes

    def slot_ranks(self, layer: int, modules: tuple[str, ...]) -> torch.Tensor:
        """[max_loras] int32: the rank each slot needs for these projections of `layer`, applied at once."""
        return self.rank_bounds[modules][layer]
