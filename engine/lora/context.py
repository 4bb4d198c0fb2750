"""The per-step LoRA inputs the model layers need, and how a fused projection applies them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import lora_kernels
from engine.lora.slots import LoRASlots


@dataclass
class LoRAContext:
    """Built once per step by the model runner; None in steps where no token uses an adapter."""

    slots: LoRASlots
    token_slots: torch.Tensor  # [num_tokens] int32, NO_LORA (-1) for base-model tokens

    def apply(
        self,
        y: torch.Tensor,  # [num_tokens, sum(out of modules)], the fused projection's output
        x: torch.Tensor,  # [num_tokens, in]
        layer: int,
        modules: tuple[str, ...],  # the projections fused into y, in column order
    ) -> None:
        targets = [self.slots.layers[layer][m] for m in modules]
        if len(targets) == 1:
            t = targets[0]
            lora_kernels.add_lora(y, x, t.lora_a, t.lora_b, self.token_slots, t.scales)
            return
        lora_kernels.add_lora_multi(
            y,
            x,
            [t.lora_a for t in targets],
            [t.lora_b for t in targets],
            self.token_slots,
            [t.scales for t in targets],
            [t.lora_b.shape[1] for t in targets],
        )
