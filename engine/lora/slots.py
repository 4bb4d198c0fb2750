"""Adapter weights resident on the device: `max_loras` slots of stacked A/B per layer and projection.

The model reads these tensors directly (`lora_kernels.add_lora` indexes them by slot), so loading an
adapter is a copy into a slot and never reallocates anything the model holds. The layout is slot-major:
all of one slot's weights (every layer and projection, A and B) form one contiguous block of `weights`,
and all of its scales and ranks one column of `table`. Making an adapter resident is therefore two
copies from its pinned row of the CPU tier, however many layers the model has; per-projection views
with a slot stride give the kernels their usual [max_loras, ...] stacks. (A layer-major layout needed one copy per
projection into views strided across layers, 30 in all, which cost the engine thread ~0.6 ms of host
time per adapter and slowed the running batch; docs/BENCHMARKS.md, adapter loading.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from adapter_format.checkpoint import PeftAdapter
from adapter_format.model_shape import TARGET_MODULES, ModelShape

# Projections the model applies LoRA to in one launch (one fused base GEMM), in column order.
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# Every block starts on a 64-element boundary, so every view is 128-byte aligned and Triton compiles one
# kernel variant for all of them.
_ALIGN = 64

# Columns of the per-layer table: a scale (float32 bits) and a rank per projection, then each fused
# group's largest rank.
_SCALES = slice(0, len(TARGET_MODULES))  # in TARGET_MODULES order
_RANKS = slice(len(TARGET_MODULES), 2 * len(TARGET_MODULES))
_SCALE_COLUMN = {m: _SCALES.start + i for i, m in enumerate(TARGET_MODULES)}
_RANK_COLUMN = {m: _RANKS.start + i for i, m in enumerate(TARGET_MODULES)}
_BOUND_COLUMN = {g: _RANKS.stop + i for i, g in enumerate(FUSED_PROJECTIONS)}
TABLE_COLUMNS = _RANKS.stop + len(FUSED_PROJECTIONS)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Where each projection's A and B sit inside one slot's block of weights."""

    shape: ModelShape
    max_rank: int

    def blocks(self) -> dict[tuple[str, str], tuple[int, tuple[int, ...]]]:
        """(module, "a" or "b") -> (offset, [num_layers, rows, cols]) inside the slot's block."""
        n, r, offset, blocks = self.shape.num_layers, self.max_rank, 0, {}
        for module in TARGET_MODULES:
            in_features, out_features = self.shape.module_dims(module)
            for kind, dims in (("a", (n, r, in_features)), ("b", (n, out_features, r))):
                blocks[module, kind] = (offset, dims)
                offset = _align(offset + math.prod(dims))
        return blocks

    @property
    def numel(self) -> int:
        offset, dims = self.blocks()[TARGET_MODULES[-1], "b"]
        return _align(offset + math.prod(dims))


@dataclass
class ModuleSlots:
    """One projection of one layer, across all slots (views into `LoRASlots`' tensors)."""

    lora_a: torch.Tensor  # [max_loras, max_rank, in], slot stride: a slot's whole block
    lora_b: torch.Tensor  # [max_loras, out, max_rank], likewise
    scales: torch.Tensor  # [max_loras] float32; 0 where the slot's adapter does not target this module
    ranks: torch.Tensor  # [max_loras] int32; 0 where untargeted


@dataclass
class SlotImage:
    """An adapter laid out exactly as one slot: zero-padded to max_rank, zeros for untargeted modules.

    Usually a row of the CPU tier (engine/lora/host_tier.py; pinned when CUDA is present), so making it
    resident is two plain host-to-device copies that can run on a side stream. The per-module views are
    made on first use: the engine itself only ever copies the two tensors.
    """

    layout: SlotLayout
    weights: torch.Tensor  # [SlotLayout.numel], the slot's whole block
    table: torch.Tensor  # [num_layers, TABLE_COLUMNS] int32 (scales as float32 bits)

    @property
    def num_bytes(self) -> int:
        return self.weights.numel() * self.weights.element_size()

    @cached_property
    def lora_a(self) -> dict[str, torch.Tensor]:  # module -> [num_layers, max_rank, in]
        return self._views("a")

    @cached_property
    def lora_b(self) -> dict[str, torch.Tensor]:  # module -> [num_layers, out, max_rank]
        return self._views("b")

    @cached_property
    def scales(self) -> dict[str, torch.Tensor]:  # module -> [num_layers] float32
        return {m: self.table[:, c].view(torch.float32) for m, c in _SCALE_COLUMN.items()}

    @cached_property
    def ranks(self) -> dict[str, torch.Tensor]:  # module -> [num_layers] int32
        return {m: self.table[:, c] for m, c in _RANK_COLUMN.items()}

    @cached_property
    def rank_bounds(self) -> dict[tuple[str, ...], torch.Tensor]:  # fused group -> [num_layers], largest rank
        return {g: self.table[:, c] for g, c in _BOUND_COLUMN.items()}

    def _views(self, kind: str) -> dict[str, torch.Tensor]:
        return {
            module: self.weights[offset : offset + math.prod(dims)].view(dims)
            for (module, k), (offset, dims) in self.layout.blocks().items()
            if k == kind
        }


def build_image(
    layout: SlotLayout,
    dtype: torch.dtype,
    adapter: PeftAdapter,
    pin_memory: bool = False,
    out: SlotImage | None = None,
) -> SlotImage:
    """Lay an adapter (validated against the model) out as one slot of `layout`, on the CPU: into `out`
    (a row of the CPU tier, overwritten whole), or into new tensors, page-locked with `pin_memory`."""
    if adapter.rank > layout.max_rank:
        raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {layout.max_rank}")
    if out is None:
        weights = torch.zeros(layout.numel, dtype=dtype, pin_memory=pin_memory)
        table = torch.zeros(layout.shape.num_layers, TABLE_COLUMNS, dtype=torch.int32, pin_memory=pin_memory)
        image = SlotImage(layout, weights, table)
    else:
        if out.layout != layout or out.weights.dtype != dtype:
            raise ValueError("the image to write into has another layout or dtype")
        image, weights, table = out, out.weights.zero_(), out.table.zero_()
    # As few torch calls as possible: on a loader thread, each call is a GIL hand-over that the engine
    # thread pays for (docs/BENCHMARKS.md, adapter loading).
    for (layer, module), pair in adapter.modules.items():
        image.lora_a[module][layer, : pair.rank] = pair.lora_a
        image.lora_b[module][layer, :, : pair.rank] = pair.lora_b
    if adapter.modules:
        layers = torch.tensor([layer for layer, _ in adapter.modules])
        modules = torch.tensor([TARGET_MODULES.index(module) for _, module in adapter.modules])
        pairs = adapter.modules.values()
        table[:, _SCALES].view(torch.float32)[layers, modules] = torch.tensor([p.scale for p in pairs])
        table[:, _RANKS][layers, modules] = torch.tensor([p.rank for p in pairs], dtype=torch.int32)
    for group, bound in image.rank_bounds.items():
        bound.copy_(torch.stack([image.ranks[m] for m in group]).amax(0))
    return image


class LoRASlots:
    """Stacked adapter weights; `layers[i][module]` is that projection's ModuleSlots for layer i."""

    def __init__(
        self, shape: ModelShape, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ):
        self.shape = shape
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.layout = SlotLayout(shape, max_rank)
        n = shape.num_layers
        self.weights = torch.zeros(max_loras, self.layout.numel, dtype=dtype, device=device)
        self.table = torch.zeros(n, TABLE_COLUMNS, max_loras, dtype=torch.int32, device=device)
        self.lora_a: dict[str, torch.Tensor] = {}  # module -> [num_layers, max_loras, max_rank, in]
        self.lora_b: dict[str, torch.Tensor] = {}  # module -> [num_layers, max_loras, out, max_rank]
        for (module, kind), (offset, dims) in self.layout.blocks().items():
            size = math.prod(dims)
            view = self.weights[:, offset : offset + size].view(max_loras, *dims).transpose(0, 1)
            (self.lora_a if kind == "a" else self.lora_b)[module] = view
        # module -> [num_layers, max_loras]; each layer's row is contiguous, as the kernels need.
        self.scales = {m: self.table[:, c].view(torch.float32) for m, c in _SCALE_COLUMN.items()}
        self.ranks = {m: self.table[:, c] for m, c in _RANK_COLUMN.items()}
        # Per group the model applies at once, the largest rank of its projections per layer and slot:
        # the kernels skip the zero-padded tail beyond it, so a rank-8 adapter does not pay for max_rank.
        self.rank_bounds: dict[tuple[str, ...], torch.Tensor] = {(m,): self.ranks[m] for m in TARGET_MODULES}
        self.rank_bounds.update({g: self.table[:, c] for g, c in _BOUND_COLUMN.items()})
        self.layers: list[dict[str, ModuleSlots]] = [
            {
                m: ModuleSlots(self.lora_a[m][i], self.lora_b[m][i], self.scales[m][i], self.ranks[m][i])
                for m in TARGET_MODULES
            }
            for i in range(n)
        ]

    def image(self, adapter: PeftAdapter, pin_memory: bool = False) -> SlotImage:
        """Lay an adapter (validated against this model) out as one slot, on the CPU."""
        return build_image(self.layout, self.dtype, adapter, pin_memory)

    def load(self, slot: int, image: SlotImage) -> None:
        """Copy an adapter's image into `slot` (asynchronously on CUDA when the image is pinned): two copies."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.max_loras})")
        self.weights[slot].copy_(image.weights, non_blocking=True)
        self.table[:, :, slot].copy_(image.table, non_blocking=True)

    def slot_ranks(self, layer: int, modules: tuple[str, ...]) -> torch.Tensor:
        """[max_loras] int32: the rank each slot needs for these projections of `layer`, applied at once."""
        return self.rank_bounds[modules][layer]
