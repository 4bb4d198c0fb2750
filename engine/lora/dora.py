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

from dataclasses import dataclass

import torch
from torch import nn

from engine.lora.slots import PAGE_RANK, SlotImage
from engine.model.fp8_linear import expand_scale

# Rows of W + s B A formed at once (float32): bounds the temporary to ~64 MiB for a 4096-wide input.
ROWS_PER_CHUNK = 4096


def dense_rows(kernel, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of a projection's weight as a new float32 tensor [rows, in] (never a view: the
    caller adds to it), dequantized if it is FP8."""
    if isinstance(kernel, torch.Tensor):
        return kernel[start:end].to(torch.float32, copy=True)
    weight = kernel.weight[start:end].float()  # an Fp8Linear
    return weight * expand_scale(kernel.scale[start:end], weight.shape[1], kernel.group_size)


def squared_norms(
    kernel,  # the projection's weight (a tensor [out, in] or an Fp8Linear)
    rows: tuple[int, int],  # the module's output rows within it
    lora_a: torch.Tensor,  # [rank, in]
    lora_b: torch.Tensor,  # [out, rank]
    scale: float,
) -> torch.Tensor:  # [out] float32
    """||W + scale * B A||^2 per output row, in float32 (over this rank's input columns)."""
    a, b = lora_a.float(), lora_b.float()
    squares = torch.empty(rows[1] - rows[0], dtype=torch.float32, device=a.device)
    for start in range(0, squares.numel(), ROWS_PER_CHUNK):
        end = min(start + ROWS_PER_CHUNK, squares.numel())
        w = dense_rows(kernel, rows[0] + start, rows[0] + end)
        w.addmm_(b[start:end], a, alpha=scale)
        squares[start:end] = w.square().sum(1)
    return squares


@dataclass
class _Job:
    """A DoRA adapter just copied into `slot`, whose scales are still to be made."""

    slot: int
    magnitudes: torch.Tensor  # [num_layers, output_width] on the device, a copy
    ranks: list[list[int]]  # [layer][target]
    scales: list[list[float]]  # [layer][target]
    copied: torch.cuda.Event | None  # the end of the slot's copy, on the stream that made it


class DoraBase:
    """Where each (layer, target)'s base weight rows live in the model, for DoRA's norms.

    Under tensor parallelism (`group`), a row-parallel projection's rows are cut by input column, so each
    rank has a partial sum of every squared norm: the scales are then made by every rank together, in
    `finish` (rank 0 as it sends a step's header, the workers once they applied its loads), with one
    all-reduce; without it, `fill_scales` makes them at once, on the copy's stream.
    """

    def __init__(self, model: nn.Module, layout, group=None, row_parallel: tuple[str, ...] = ()) -> None:
        self.layout = layout  # this rank's (the shards' under tensor parallelism)
        self.group = group
        self.row_parallel = row_parallel if group is not None else ()
        self._pending: list[_Job] = []
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
        """Make the slot's DoRA scales from the pages just copied into the pool and the image's magnitudes
        (now, or in `finish` under tensor parallelism); untargeted projections keep 1."""
        columns = len(self.layout.targets)
        job = _Job(
            slot,
            image.magnitudes.to(pool.device, copy=True, non_blocking=True),  # the row may be refilled
            image.table[:, self.layout.rank_columns].tolist(),  # the image is on the CPU: no sync
            image.table[:, :columns].view(torch.float32).tolist(),
            None,
        )
        if self.group is None:
            self._make(pool, [job])
            return
        if pool.device.type == "cuda":
            job.copied = torch.cuda.Event()
            job.copied.record()
        self._pending.append(job)

    def finish(self, pool) -> None:
        """Tensor parallelism: make the scales of every DoRA slot loaded since the last call, on every rank
        in the same order (each rank's loads are rank 0's, in order)."""
        jobs, self._pending = self._pending, []
        if jobs:
            self._make(pool, jobs)

    def _make(self, pool, jobs: list[_Job]) -> None:
        norms: list[tuple[_Job, int, str, torch.Tensor]] = []
        for job in jobs:
            if job.copied is not None:
                torch.cuda.current_stream(pool.device).wait_event(job.copied)
            pool.dora_scales[:, job.slot].fill_(1.0)  # projections the adapter leaves alone
            page_ids = pool.page_table[job.slot].long()
            for (layer, target), (linear, rows) in self._rows.items():
                column = self.layout.targets.index(target)
                rank = job.ranks[layer][column]
                if rank == 0:
                    continue
                slots = pool.layers[layer][target]
                pages = page_ids[: -(-rank // PAGE_RANK)]
                lora_a = slots.lora_a[pages].flatten(0, 1)[:rank]  # [rank, in]
                lora_b = slots.lora_b[pages].transpose(0, 1).flatten(1)[:, :rank]  # [out, rank]
                squares = squared_norms(linear.kernel, rows, lora_a, lora_b, job.scales[layer][column])
                norms.append((job, layer, target, squares))
        partial = [squares for _, _, target, squares in norms if target in self.row_parallel]
        if partial:  # each rank summed its own input columns: one all-reduce completes every row's norm
            summed = self.group.all_reduce(torch.cat(partial)).split([t.numel() for t in partial])
            for squares, total in zip(partial, summed):
                squares.copy_(total)
        for job, layer, target, squares in norms:
            start, end = self.layout.output_columns[target]
            scale = job.magnitudes[layer, start:end].float() / squares.sqrt()
            pool.dora_scales[layer, job.slot, start:end] = scale
