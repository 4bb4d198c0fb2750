"""Plain-torch grouped LoRA: the reference the Triton kernels are tested against, and the CPU path.

Every function here loops over the slots present on the host (`unique`, `tolist`), so each call syncs:
fine for the CPU and for tests, never for a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def add_lora(
    y: torch.Tensor,  # [num_tokens, out], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, max_rank, in]
    lora_b: torch.Tensor,  # [num_slots, out, max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int, -1: no adapter
    scales: torch.Tensor,  # [num_slots] float32
    slot_ranks: torch.Tensor | None = None,  # [num_slots] int, rank of each slot (<= max_rank)
) -> torch.Tensor:
    """In place, `y[t] += scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T` for `s = token_slots[t] >= 0`.

    Loops over the slots present (one host sync for `unique`), computing in at least float32 so that
    half-precision inputs are not rounded between the two products. With `slot_ranks`, slot `s` uses only
    its first `slot_ranks[s]` ranks (the zero-padded tail is ignored).
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    slots = token_slots.to(torch.long)
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rank = lora_a.shape[1] if slot_ranks is None else int(slot_ranks[slot])
        rows = (slots == slot).nonzero().squeeze(1)
        h = x.index_select(0, rows).to(compute_dtype) @ lora_a[slot, :rank].to(compute_dtype).T
        delta = (h @ lora_b[slot, :, :rank].to(compute_dtype).T) * scales[slot].to(compute_dtype)
        y.index_add_(0, rows, delta.to(y.dtype))
    return y


def add_lora_multi(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_as: Sequence[torch.Tensor],  # num_slices x [num_slots, max_rank, in]
    lora_bs: Sequence[torch.Tensor],  # num_slices x [num_slots, output_slices[i], max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int, -1: no adapter
    scales: Sequence[torch.Tensor],  # num_slices x [num_slots] float32
    output_slices: Sequence[int],  # widths of y's consecutive column slices
    slot_ranks: torch.Tensor | None = None,  # [num_slots] int
) -> torch.Tensor:
    """`add_lora` once per slice of a fused projection (q/k/v, gate/up), on column views of `y`."""
    offset = 0
    for lora_a, lora_b, slice_scales, width in zip(lora_as, lora_bs, scales, output_slices):
        add_lora(y[:, offset : offset + width], x, lora_a, lora_b, token_slots, slice_scales, slot_ranks)
        offset += width
    return y


def shrink(
    x: torch.Tensor,  # [num_tokens, in]
    lora_as: Sequence[torch.Tensor],  # num_slices x [num_slots, max_rank, in]
    token_slots: torch.Tensor,  # [num_tokens] int, -1: no adapter
    slot_ranks: torch.Tensor | None = None,  # [num_slots] int
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank], float64 for float64 x, else float32
    """`h[i, t] = x[t] @ lora_as[i][s].T` for `s = token_slots[t] >= 0`; zeros elsewhere (and past the rank)."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    num_slots, max_rank, _ = lora_as[0].shape
    h = x.new_zeros((len(lora_as), x.shape[0], max_rank), dtype=compute_dtype)
    slots = token_slots.to(torch.long)
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rank = max_rank if slot_ranks is None else int(slot_ranks[slot])
        rows = (slots == slot).nonzero().squeeze(1)
        for i, lora_a in enumerate(lora_as):
            h[i, rows, :rank] = (
                x.index_select(0, rows).to(compute_dtype) @ lora_a[slot, :rank].to(compute_dtype).T
            )
    return h


def expand(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place
    h: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    lora_bs: Sequence[torch.Tensor],  # num_slices x [num_slots, output_slices[i], max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int, -1: no adapter
    scales: Sequence[torch.Tensor],  # num_slices x [num_slots] float32
    slot_ranks: torch.Tensor | None = None,  # [num_slots] int
) -> torch.Tensor:
    """In place, `y[t, slice i] += scales[i][s] * h[i, t] @ lora_bs[i][s].T` for `s = token_slots[t] >= 0`."""
    compute_dtype = torch.promote_types(h.dtype, torch.float32)
    slots = token_slots.to(torch.long)
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        offset = 0
        for i, (lora_b, slice_scales) in enumerate(zip(lora_bs, scales)):
            rank = lora_b.shape[2] if slot_ranks is None else int(slot_ranks[slot])
            delta = h[i, rows, :rank].to(compute_dtype) @ lora_b[slot, :, :rank].to(compute_dtype).T
            delta = delta * slice_scales[slot].to(compute_dtype)
            width = lora_b.shape[1]
            y[:, offset : offset + width].index_add_(0, rows, delta.to(y.dtype))
            offset += width
    return y


def add_lora_paged(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    pool_as: Sequence[torch.Tensor],  # num_slices x [num_pages, page, in]
    pool_bs: Sequence[torch.Tensor],  # num_slices x [num_pages, output_slices[i], page]
    page_table: torch.Tensor,  # [num_slots, max_pages] int
    token_slots: torch.Tensor,  # [num_tokens] int, -1: no adapter
    scales: Sequence[torch.Tensor],  # num_slices x [num_slots] float32
    output_slices: Sequence[int],
    slot_ranks: torch.Tensor,  # [num_slots] int
    dora: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([num_slots, out] scales, [num_slots] flags)
) -> torch.Tensor:
    """`add_lora_multi` over paged weights: each slot present gathers its pages into dense A and B.
    A DoRA slot's tokens become `(y + update) * dora_scales[slot]`."""
    page = pool_as[0].shape[1]
    slots = token_slots.to(torch.long)
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rank = int(slot_ranks[slot])
        pages = page_table[slot, : -(-rank // page)].to(torch.long)
        dense_as = [p[pages].reshape(-1, p.shape[2])[None, :rank] for p in pool_as]  # [1, rank, in]
        dense_bs = [p[pages].transpose(0, 1).flatten(1)[None, :, :rank] for p in pool_bs]  # [1, out, rank]
        rows = (slots == slot).nonzero().squeeze(1)
        delta = y.new_zeros((rows.numel(), y.shape[1]))
        add_lora_multi(
            delta,
            x.index_select(0, rows),
            dense_as,
            dense_bs,
            torch.zeros(rows.numel(), dtype=torch.int32, device=x.device),
            [s[slot : slot + 1] for s in scales],
            output_slices,
        )
        if dora is not None and int(dora[1][slot]) != 0:
            compute_dtype = torch.promote_types(y.dtype, torch.float32)
            updated = (y.index_select(0, rows).to(compute_dtype) + delta) * dora[0][slot].to(compute_dtype)
            y.index_copy_(0, rows, updated.to(y.dtype))
        else:
            y.index_add_(0, rows, delta)
    return y
