"""Adapter weights resident on the device: `max_loras` slots of stacked A/B per layer and projection.

The model reads these tensors directly (`lora_kernels.add_lora` indexes them by slot), so loading an
adapter is a copy into a slot and never reallocates anything the model holds. Each projection's
tensors span all layers ([num_layers, max_loras, ...]): a layer's view is contiguous for the kernels,
and loading one adapter is one copy per projection and tensor (30 copies with scales, ranks and rank
bounds), not one per layer. The slot views are strided across layers, which makes each copy cost the
calling thread far more than a contiguous one would (docs/BENCHMARKS.md, adapter loading).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.model_shape import TARGET_MODULES, ModelShape
from engine.lora.peft_checkpoint import PeftAdapter

# Projections the model applies LoRA to in one launch (one fused base GEMM), in column order.
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class ModuleSlots:
    """One projection of one layer, across all slots (views into `LoRASlots`' tensors)."""

    lora_a: torch.Tensor  # [max_loras, max_rank, in]
    lora_b: torch.Tensor  # [max_loras, out, max_rank]
    scales: torch.Tensor  # [max_loras] float32; 0 where the slot's adapter does not target this module
    ranks: torch.Tensor  # [max_loras] int32; 0 where untargeted


@dataclass
class SlotImage:
    """An adapter laid out exactly as one slot: zero-padded to max_rank, zeros for untargeted modules.

    Built once per adapter on the CPU (pinned when CUDA is present), so making it resident is a
    plain host-to-device copy that can run on a side stream.
    """

    lora_a: dict[str, torch.Tensor]  # module -> [num_layers, max_rank, in]
    lora_b: dict[str, torch.Tensor]  # module -> [num_layers, out, max_rank]
    scales: dict[str, torch.Tensor]  # module -> [num_layers] float32
    ranks: dict[str, torch.Tensor]  # module -> [num_layers] int32
    rank_bounds: dict[tuple[str, ...], torch.Tensor]  # fused group -> [num_layers] int32, its largest rank

    @property
    def num_bytes(self) -> int:
        tensors = [*self.lora_a.values(), *self.lora_b.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


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
        n = shape.num_layers
        self.lora_a: dict[str, torch.Tensor] = {}  # module -> [num_layers, max_loras, max_rank, in]
        self.lora_b: dict[str, torch.Tensor] = {}  # module -> [num_layers, max_loras, out, max_rank]
        self.scales: dict[str, torch.Tensor] = {}  # module -> [num_layers, max_loras]
        self.ranks: dict[str, torch.Tensor] = {}  # module -> [num_layers, max_loras]
        for module in TARGET_MODULES:
            in_features, out_features = shape.module_dims(module)
            self.lora_a[module] = torch.zeros(n, max_loras, max_rank, in_features, dtype=dtype, device=device)
            self.lora_b[module] = torch.zeros(n, max_loras, out_features, max_rank, dtype=dtype, device=device)
            self.scales[module] = torch.zeros(n, max_loras, dtype=torch.float32, device=device)
            self.ranks[module] = torch.zeros(n, max_loras, dtype=torch.int32, device=device)
        # Per group the model applies at once, the largest rank of its projections per layer and slot:
        # the kernels skip the zero-padded tail beyond it, so a rank-8 adapter does not pay for max_rank.
        self.rank_bounds: dict[tuple[str, ...], torch.Tensor] = {(m,): self.ranks[m] for m in TARGET_MODULES}
        for group in FUSED_PROJECTIONS:
            self.rank_bounds[group] = torch.zeros(n, max_loras, dtype=torch.int32, device=device)
        self.layers: list[dict[str, ModuleSlots]] = [
            {
                m: ModuleSlots(self.lora_a[m][i], self.lora_b[m][i], self.scales[m][i], self.ranks[m][i])
                for m in TARGET_MODULES
            }
            for i in range(n)
        ]

    def image(self, adapter: PeftAdapter, pin_memory: bool = False) -> SlotImage:
        """Lay an adapter (validated against this model) out as one slot, on the CPU."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        n, r = self.shape.num_layers, self.max_rank
        image = SlotImage({}, {}, {}, {}, {})
        # Pinned from the start (not pinned afterwards), so the image is written once, not copied again.
        pinned = {"pin_memory": pin_memory}
        for module in TARGET_MODULES:
            in_features, out_features = self.shape.module_dims(module)
            image.lora_a[module] = torch.zeros(n, r, in_features, dtype=self.dtype, **pinned)
            image.lora_b[module] = torch.zeros(n, out_features, r, dtype=self.dtype, **pinned)
            image.scales[module] = torch.zeros(n, dtype=torch.float32, **pinned)
            image.ranks[module] = torch.zeros(n, dtype=torch.int32, **pinned)
        for (layer, module), weights in adapter.modules.items():
            rank = weights.rank
            image.lora_a[module][layer, :rank] = weights.lora_a
            image.lora_b[module][layer, :, :rank] = weights.lora_b
            image.scales[module][layer] = weights.scale
            image.ranks[module][layer] = rank
        for group in FUSED_PROJECTIONS:
            bound = torch.zeros(n, dtype=torch.int32, **pinned)
            image.rank_bounds[group] = torch.amax(torch.stack([image.ranks[m] for m in group]), 0, out=bound)
        return image

    def load(self, slot: int, image: SlotImage) -> None:
        """Copy an adapter's image into `slot` (asynchronously on CUDA when the image is pinned)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.max_loras})")
        for module in TARGET_MODULES:
            self.lora_a[module][:, slot].copy_(image.lora_a[module], non_blocking=True)
            self.lora_b[module][:, slot].copy_(image.lora_b[module], non_blocking=True)
            self.scales[module][:, slot].copy_(image.scales[module], non_blocking=True)
            self.ranks[module][:, slot].copy_(image.ranks[module], non_blocking=True)
        for group in FUSED_PROJECTIONS:
            self.rank_bounds[group][:, slot].copy_(image.rank_bounds[group], non_blocking=True)

    def slot_ranks(self, layer: int, modules: tuple[str, ...]) -> torch.Tensor:
        """[max_loras] int32: the rank each slot needs for these projections of `layer`, applied at once."""
        return self.rank_bounds[modules][layer]
