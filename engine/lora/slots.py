"""Adapter weights resident on the device: `max_loras` slots of stacked A/B per layer and projection.

The model reads these tensors directly (`lora_kernels.add_lora` indexes them by slot), so loading an
adapter is a copy into a slot and never reallocates anything the model holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.model_shape import TARGET_MODULES, ModelShape
from engine.lora.peft_checkpoint import PeftAdapter


@dataclass
class ModuleSlots:
    """One projection of one layer, across all slots. Ranks below max_rank are zero-padded."""

    lora_a: torch.Tensor  # [max_loras, max_rank, in]
    lora_b: torch.Tensor  # [max_loras, out, max_rank]
    scales: torch.Tensor  # [max_loras] float32; 0 where the slot's adapter does not target this module
    ranks: torch.Tensor  # [max_loras] int32; 0 where untargeted


class LoRASlots:
    """Stacked adapter weights: `layers[i][module]` is that projection's ModuleSlots."""

    def __init__(
        self, shape: ModelShape, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ):
        self.shape = shape
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: list[dict[str, ModuleSlots]] = []
        for _ in range(shape.num_layers):
            modules = {}
            for module in TARGET_MODULES:
                in_features, out_features = shape.module_dims(module)
                modules[module] = ModuleSlots(
                    lora_a=torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device),
                    lora_b=torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device),
                    scales=torch.zeros(max_loras, dtype=torch.float32, device=device),
                    ranks=torch.zeros(max_loras, dtype=torch.int32, device=device),
                )
            self.layers.append(modules)

    def load(self, slot: int, adapter: PeftAdapter) -> None:
        """Copy an adapter (already validated against the model) into `slot`, replacing what was there."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.max_loras})")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        self.clear(slot)
        for (layer, module), weights in adapter.modules.items():
            target = self.layers[layer][module]
            rank = weights.rank
            target.lora_a[slot, :rank].copy_(weights.lora_a, non_blocking=True)
            target.lora_b[slot, :, :rank].copy_(weights.lora_b, non_blocking=True)
            target.scales[slot] = weights.scale
            target.ranks[slot] = rank

    def clear(self, slot: int) -> None:
        for modules in self.layers:
            for target in modules.values():
                target.lora_a[slot].zero_()
                target.lora_b[slot].zero_()
                target.scales[slot] = 0.0
                target.ranks[slot] = 0
