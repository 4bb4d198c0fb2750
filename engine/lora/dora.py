"""DoRA's column scales: what a DoRA adapter multiplies each output row of a projection by.

PEFT's DoRA layer computes `result = magnitude / ||W + s B A||_row * (W x + s B A x)` (+ bias, unscaled),
the norm taken over each output row's inputs and treated as a constant (detached). The norm depends on the
adapter and the base weights only, never on the tokens, so it is computed once, when the adapter is
copied into a GPU slot (on the copy stream, before the slot is admitted), into the pool's `dora_scales`
row of that slot: g = magnitude / ||W + s B A|| per output row. Each step then costs one float32 load
per output column and token of a DoRA slot, inside the expand kernel (`lora_kernels.add_lora_paged`'s
`dora_scales`): `y = (W x + s B A x) * g`. A projection with a bias adds it after the LoRA update
(engine/model/layers/linear.py), so g never scales it, as in PEFT.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.lora.slots import PAGE_RANK, SlotImage

# Rows of W + s B A formed at once (float32): bounds the temporary to ~64 MiB for a 4096-wide input.
ROWS_PER_CHUNK = 4096


def dense_rows(kernel, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a projection's weight as a new float32 tensor [rows, in] (never a view: the
    caller adds to it), dequantized if it is FP8."""
    if isinstance(kernel, torch.Tensor):
        return kernel[start:end].to(torch.float32, copy=True)
    weight, scale = kernel.weight[start:end].float(), kernel.scale[start:end]  # Fp8Linear
    return weight * scale.repeat_interleave(kernel.group_size, dim=1)[:, : weight.shape[1]]


def column_scales(
    kernel,  # the projection's weight (a tensor [out, in] or an Fp8Linear)
    rows: tuple[int, int],  # the module's output rows within it
    lora_a: torch.Tensor,  # [rank, in]
    lora_b: torch.Tensor,  # [out, rank]
    scale: float,
    magnitude: torch.Tensor,  # [out]
) -> torch.Tensor:  # [out] float32
    """magnitude / ||W + scale * B A|| per output row, in float32."""
    a, b = lora_a.float(), lora_b.float()
    norms = torch.empty(rows[1] - rows[0], dtype=torch.float32, device=a.device)
    for start in range(0, norms.numel(), ROWS_PER_CHUNK):
        end = min(start + ROWS_PER_CHUNK, norms.numel())
        w = dense_rows(kernel, rows[0] + start, rows[0] + end)
        w.addmm_(b[start:end], a, alpha=scale)
        norms[start:end] = torch.linalg.vector_norm(w, dim=1)
    return magnitude.float() / norms


class DoraBase:
    """Where each (layer, target)'s base weight rows live in the model, for DoRA's norms."""

    def __init__(self, model: nn.Module, layout) -> None:
        self.layout = layout
        self._rows: dict[tuple[int, str], tuple[nn.Module, tuple[int, int]]] = {}
        for module in model.modules():
            layer, targets = getattr(module, "layer", None), getattr(module, "lora_modules", ())
            if layer is None or not targets or not hasattr(module, "kernel"):
                continue
            start = 0
            for target in targets:  # the fused projection's parts, in column order
                width = layout.shape.module_dims(target)[1]
                self._rows[layer, target] = (module, (start, start + width))
                start += width

    def fill_scales(self, pool, slot: int, image: SlotImage) -> None:
        """Write the slot's DoRA scales from the pages just copied into the pool and the image's
        magnitudes; untargeted projections keep 1."""
        scales = pool.dora_scales[:, slot]  # [num_layers, output_width]
        scales.fill_(1.0)
        page_ids = pool.page_table[slot].long()
        magnitudes = image.magnitudes.to(pool.device, non_blocking=True)
        ranks = image.table[:, self.layout.rank_columns].tolist()  # the image is on the CPU: no sync
        module_scales = image.table[:, : len(self.layout.targets)].view(torch.float32).tolist()
        for (layer, target), (linear, rows) in self._rows.items():
            column = self.layout.targets.index(target)
            rank = ranks[layer][column]
            if rank == 0:
                continue
            slots = pool.layers[layer][target]
            pages = page_ids[: -(-rank // PAGE_RANK)]
            lora_a = slots.lora_a[pages].flatten(0, 1)[:rank]  # [rank, in]
            lora_b = slots.lora_b[pages].transpose(0, 1).flatten(1)[:, :rank]  # [out, rank]
            start, end = self.layout.output_columns[target]
            scales[layer, start:end] = column_scales(
                linear.kernel,
                rows,
                lora_a,
                lora_b,
                module_scales[layer][column],
                magnitudes[layer, start:end],
            )
