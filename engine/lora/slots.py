"""An adapter's weights as the GPU pool holds them: pages of `PAGE_RANK` rank rows (S-LoRA's paging).

One page holds PAGE_RANK ranks of every layer and projection, A and B alike, so an adapter of rank r
fills ceil(r / PAGE_RANK) pages and takes r / max_lora_rank of a max-rank adapter's memory, within
page rounding (engine/lora/pool.py keeps the pages on the device). Inside a page, each projection's A
is a block [num_layers, PAGE_RANK, in] (rank rows) and its B a block [num_layers, out, PAGE_RANK]
(ranks innermost, as in B itself), so a page table maps an adapter's rank r to page
`pages[r // PAGE_RANK]`, position `r % PAGE_RANK`, and one view per layer and projection
([num_pages, PAGE_RANK, in] and [num_pages, out, PAGE_RANK]) is what the kernels read
(lora_kernels.add_lora_paged). Both keep the kernels' loads as over dense stacks: A's rows contiguous
along the input, B's ranks contiguous in runs of PAGE_RANK (one 16-byte vector in bf16).

The image of an adapter (a row of the CPU tier, engine/lora/host_tier.py) is the same pages, laid out
one after the other with room for max_lora_rank, plus a table of its scales and ranks. Making it
resident copies its first ceil(r / PAGE_RANK) pages into the pool's pages (one copy per run of
consecutive pool pages, usually one) and the table into the adapter's slot; nothing per layer, so
loading costs the engine thread a few copies however deep the model is (docs/BENCHMARKS.md, adapter
loading).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from adapter_format.checkpoint import PeftAdapter
from adapter_format.errors import AdapterError
from adapter_format.model_shape import SHARED_EXPERT_MODULES, SHARED_EXPERTS_MODULES, ModelShape
from engine.lora.pages import pages_for_rank
from engine.lora.vocab import TABLE_COLUMNS, write_vocab

# A load that found an adapter with its own embedding or LM head in a row without room for them: the
# manager loads it again into a row that has room (engine/lora/vocab.py).
NEEDS_VOCAB_ROW = "needs_vocab_row"

# Rank rows per page: ranks 8, 16 and 64 fill whole pages; rank 4 wastes half of one.
PAGE_RANK = 8

# Projections the model applies LoRA to in one launch (one fused base GEMM), in column order, where an
# architecture targets them separately; a checkpoint that fuses them (Phi-3's qkv_proj) has one target.
FUSED_PROJECTIONS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    SHARED_EXPERT_MODULES[:2],  # a mixture of experts' shared expert's gate and up (Qwen2-MoE)
    SHARED_EXPERTS_MODULES[:2],  # GLM-4.5's shared experts' gate and up
)


def lora_launches(targets: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The groups of targets a layer applies LoRA to, one kernel launch each, in order: q/k/v, o, gate/up,
    down for the seven Llama-family targets; qkv_proj, o_proj, gate_up_proj, down_proj for Phi-3."""
    launches: list[tuple[str, ...]] = []
    for module in targets:
        group = next((g for g in FUSED_PROJECTIONS if module in g and set(g) <= set(targets)), (module,))
        if group not in launches:
            launches.append(group)
    return launches


# Every block starts on a 64-element boundary, so every view is 128-byte aligned and Triton compiles one
# kernel variant for all of them.
_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Where each projection's A and B^T sit inside one page, how many pages an image has room for, and
    the columns of the per-layer table: a scale (float32 bits) per target (the architecture's
    `shape.targets`, in order), the DoRA flag, a rank per target, then each fused group's largest rank."""

    shape: ModelShape
    max_rank: int

    @property
    def targets(self) -> tuple[str, ...]:
        return self.shape.targets

    @cached_property
    def fused_groups(self) -> tuple[tuple[str, ...], ...]:
        return tuple(g for g in lora_launches(self.targets) if len(g) > 1)

    @cached_property
    def scale_column(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.targets)}

    @property
    def dora_column(self) -> int:
        """1 in every layer where the adapter is DoRA (its output rows scaled by magnitude / norm); before
        the ranks, so that every column from `rank_columns.start` on is a rank the kernels read."""
        return len(self.targets)

    @cached_property
    def rank_column(self) -> dict[str, int]:
        return {m: len(self.targets) + 1 + i for i, m in enumerate(self.targets)}

    @cached_property
    def bound_column(self) -> dict[tuple[str, ...], int]:
        return {g: 2 * len(self.targets) + 1 + i for i, g in enumerate(self.fused_groups)}

    @property
    def rank_columns(self) -> slice:
        return slice(len(self.targets) + 1, 2 * len(self.targets) + 1)

    @property
    def table_columns(self) -> int:
        return 2 * len(self.targets) + 1 + len(self.fused_groups)

    @cached_property
    def output_columns(self) -> dict[str, tuple[int, int]]:
        """module -> [start, end) of its outputs in a layer's row of DoRA magnitudes and scales: the
        targets' outputs one after another, so each launch group's columns are contiguous, as in y."""
        columns, start = {}, 0
        for module in self.targets:
            width = self.shape.module_dims(module)[1]
            columns[module] = (start, start + width)
            start += width
        return columns

    @property
    def output_width(self) -> int:
        return max(end for _, end in self.output_columns.values())

    def blocks(self) -> dict[tuple[str, str], tuple[int, tuple[int, ...]]]:
        """(module, "a" or "b") -> (offset, dims) inside a page: A [num_layers, PAGE_RANK, in], B
        [num_layers, out, PAGE_RANK]; a mixture of experts' stacked expert weights hold a pair per expert,
        A [num_layers, E, PAGE_RANK, in] and B [num_layers, E, out, PAGE_RANK]."""
        n, offset, blocks = self.shape.num_layers, 0, {}
        for module in self.targets:
            in_features, out_features = self.shape.module_dims(module)
            experts = self.shape.module_experts(module)
            per = (experts,) if experts > 1 or module.startswith("experts.") else ()
            pair = (("a", (n, *per, PAGE_RANK, in_features)), ("b", (n, *per, out_features, PAGE_RANK)))
            for kind, dims in pair:
                blocks[module, kind] = (offset, dims)
                offset = _align(offset + math.prod(dims))
        return blocks

    @cached_property
    def page_numel(self) -> int:
        offset, dims = self.blocks()[self.targets[-1], "b"]
        return _align(offset + math.prod(dims))

    @property
    def max_pages(self) -> int:
        return pages_for_rank(self.max_rank, PAGE_RANK)

    @property
    def pages_numel(self) -> int:
        return self.max_pages * self.page_numel

    @property
    def numel(self) -> int:
        """Elements of an image: pages for max_rank, then DoRA magnitudes [num_layers, output_width]."""
        return self.pages_numel + self.shape.num_layers * self.output_width


@dataclass
class SlotImage:
    """An adapter laid out as pool pages (zeros past each projection's rank and for untargeted ones).

    Usually a row of the CPU tier (pinned when CUDA is present), so making it resident is a few plain
    host-to-device copies that can run on a side stream. `page_a`/`page_b` are the views `build_image`
    writes through; `lora_a`/`lora_b` are dense copies for reading (tests, introspection).
    """

    layout: SlotLayout
    weights: torch.Tensor  # [SlotLayout.numel]: max_pages pages of page_numel
    table: torch.Tensor  # [num_layers, layout.table_columns] int32 (scales as float32 bits)
    # Room for an adapter's own embedding and LM head (engine/lora/vocab.py), in a row that has it:
    # [2, vocab, hidden] and its table [2, vocab.TABLE_COLUMNS] int32.
    vocab: torch.Tensor | None = None
    vocab_table: torch.Tensor | None = None

    @property
    def pages(self) -> torch.Tensor:  # [max_pages, page_numel]
        return self.weights[: self.layout.pages_numel].view(self.layout.max_pages, self.layout.page_numel)

    @property
    def magnitudes(self) -> torch.Tensor:  # [num_layers, output_width]: DoRA's, zeros for plain LoRA
        return self.weights[self.layout.pages_numel :].view(self.layout.shape.num_layers, -1)

    @property
    def owns_vocab(self) -> bool:
        """Whether it has its own embedding or LM head (engine/lora/vocab.py)."""
        return self.vocab_table is not None and bool(self.vocab_table[:, 0].any())

    @property
    def use_dora(self) -> bool:
        return bool(self.table[0, self.layout.dora_column])

    @property
    def rank(self) -> int:
        """The adapter's largest rank over layers and projections."""
        return int(self.table[:, self.layout.rank_columns].max())

    @property
    def num_pages(self) -> int:
        """Pages the adapter fills: its rank, in pages."""
        return pages_for_rank(self.rank, PAGE_RANK)

    @property
    def num_bytes(self) -> int:
        """Bytes it takes in the pool."""
        return self.num_pages * self.layout.page_numel * self.weights.element_size()

    @cached_property
    def page_a(self) -> dict[str, torch.Tensor]:  # module -> [num_layers, max_pages, PAGE_RANK, in]
        return self._page_views("a")

    @cached_property
    def page_b(self) -> dict[str, torch.Tensor]:  # module -> [num_layers, max_pages, out, PAGE_RANK]
        return self._page_views("b")

    @property
    def lora_a(self) -> dict[str, torch.Tensor]:  # module -> [num_layers, max_pages * PAGE_RANK, in], a copy
        return {m: v.flatten(1, 2).clone() for m, v in self.page_a.items()}

    @property
    def lora_b(self) -> dict[str, torch.Tensor]:  # module -> [num_layers, out, max_pages * PAGE_RANK], a copy
        return {m: v.transpose(1, 2).flatten(2).clone() for m, v in self.page_b.items()}

    @cached_property
    def scales(self) -> dict[str, torch.Tensor]:  # module -> [num_layers] float32
        return {m: self.table[:, c].view(torch.float32) for m, c in self.layout.scale_column.items()}

    @cached_property
    def ranks(self) -> dict[str, torch.Tensor]:  # module -> [num_layers] int32
        return {m: self.table[:, c] for m, c in self.layout.rank_column.items()}

    @cached_property
    def rank_bounds(self) -> dict[tuple[str, ...], torch.Tensor]:  # fused group -> [num_layers], largest rank
        return {g: self.table[:, c] for g, c in self.layout.bound_column.items()}

    def _page_views(self, kind: str) -> dict[str, torch.Tensor]:
        pages = self.pages
        return {
            module: pages[:, offset : offset + math.prod(dims)].unflatten(1, dims).transpose(0, 1)
            for (module, k), (offset, dims) in self.layout.blocks().items()
            if k == kind
        }


def _write_rows(pages: torch.Tensor, rows: torch.Tensor) -> None:
    """Rank rows [..., r, cols] into pages [..., max_pages, PAGE_RANK, cols]: whole pages at once, then the
    rest (the leading dimension: experts)."""
    full, rest = divmod(rows.shape[-2], PAGE_RANK)
    if full:
        pages[..., :full, :, :] = rows[..., : full * PAGE_RANK, :].unflatten(-2, (full, PAGE_RANK))
    if rest:
        pages[..., full, :rest, :] = rows[..., full * PAGE_RANK :, :]


def build_image(
    layout: SlotLayout,
    dtype: torch.dtype,
    adapter: PeftAdapter,
    pin_memory: bool = False,
    out: SlotImage | None = None,
) -> SlotImage:
    """Lay an adapter (validated against the model) out as pool pages, on the CPU: into `out` (a row of
    the CPU tier, overwritten whole), or into new tensors, page-locked with `pin_memory`."""
    if adapter.rank > layout.max_rank:
        raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {layout.max_rank}")
    if adapter.vocab and out is not None and out.vocab is None:
        raise AdapterError(
            NEEDS_VOCAB_ROW, "the adapter has its own embedding or LM head: it needs a row with room for them"
        )
    if out is None:
        weights = torch.zeros(layout.numel, dtype=dtype, pin_memory=pin_memory)
        table = torch.zeros(
            layout.shape.num_layers, layout.table_columns, dtype=torch.int32, pin_memory=pin_memory
        )
        image = SlotImage(layout, weights, table)
        if adapter.vocab:
            v, h = layout.shape.vocab_size, layout.shape.hidden_size
            image.vocab = torch.zeros(2, v, h, dtype=dtype, pin_memory=pin_memory)
            image.vocab_table = torch.zeros(2, TABLE_COLUMNS, dtype=torch.int32)
    else:
        if out.layout != layout or out.weights.dtype != dtype:
            raise ValueError("the image to write into has another layout or dtype")
        image, table = out, out.table.zero_()
        out.weights.zero_()
    # As few torch calls as possible: on a loader thread, each call is a GIL hand-over that the engine
    # thread pays for (docs/BENCHMARKS.md, adapter loading).
    for (layer, module), pair in adapter.modules.items():
        a, b = image.page_a[module][layer], image.page_b[module][layer]
        if a.dim() == 4:  # per expert: pages [max_pages, E, ...] <- A [E, r, in], B [E, out, r]
            _write_rows(a.transpose(0, 1), pair.lora_a)
            _write_rows(b.permute(1, 0, 3, 2), pair.lora_b.transpose(1, 2))
            continue
        _write_rows(a, pair.lora_a)
        _write_rows(b.transpose(1, 2), pair.lora_b.T)  # B's ranks as rows
    if adapter.modules:
        layers = torch.tensor([layer for layer, _ in adapter.modules])
        modules = torch.tensor([layout.targets.index(module) for _, module in adapter.modules])
        pairs = adapter.modules.values()
        scales = table[:, : len(layout.targets)].view(torch.float32)
        scales[layers, modules] = torch.tensor([p.scale for p in pairs])
        table[:, layout.rank_columns][layers, modules] = torch.tensor(
            [p.rank for p in pairs], dtype=torch.int32
        )
    for group, bound in image.rank_bounds.items():
        bound.copy_(torch.stack([image.ranks[m] for m in group]).amax(0))
    if image.vocab_table is not None:
        write_vocab(image.vocab, image.vocab_table, adapter, layout.shape)
    if adapter.use_dora:
        table[:, layout.dora_column] = 1
        for (layer, module), pair in adapter.modules.items():
            start, end = layout.output_columns[module]
            image.magnitudes[layer, start:end] = pair.magnitude
    return image
