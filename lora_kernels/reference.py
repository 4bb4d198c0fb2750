"""Plain-torch grouped LoRA: the reference the Triton kernels are tested against, and the CPU path."""

from __future__ import annotations

import torch


def add_lora(
    y: torch.Tensor,  # [num_tokens, out], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, max_rank, in]
    lora_b: torch.Tensor,  # [num_slots, out, max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int, -1: no adapter
    scales: torch.Tensor,  # [num_slots] float32
) -> torch.Tensor:
    """In place, `y[t] += scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T` for `s = token_slots[t] >= 0`.

    Loops over the slots present (one host sync for `unique`), computing in at least float32 so that
    half-precision inputs are not rounded between the two products.
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    slots = token_slots.to(torch.long)
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        h = x.index_select(0, rows).to(compute_dtype) @ lora_a[slot].to(compute_dtype).T
        delta = (h @ lora_b[slot].to(compute_dtype).T) * scales[slot].to(compute_dtype)
        y.index_add_(0, rows, delta.to(y.dtype))
    return y
