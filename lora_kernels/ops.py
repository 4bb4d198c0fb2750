"""Public grouped-LoRA ops: argument checks, then the Triton kernels (CUDA) or the torch reference (CPU).

`backend="auto"` runs Triton on CUDA tensors and the reference elsewhere; `backend="triton"` forces the
kernels (on the CPU only under TRITON_INTERPRET=1, which is how the tests run them). `path="auto"`
chooses the gathered kernels for decode-sized batches and the segmented ones above (tiles.py says why);
`path="gathered"` / `"segmented"` force one. Nothing on the CUDA path reads a tensor back to the host,
so a decode step that calls these can be captured in a CUDA graph; pass a `meta` built once per step
(LoRABatchMeta) so the segmented path does not rebuild it in every layer.

Shapes, dtypes and layout are always checked (ValueError naming the problem). Slot values must lie in
[-1, num_slots) and slot ranks in [0, max_rank]; checking values costs a host sync, so it happens on the
CPU and with `validate=True` only (checks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lora_kernels import checks, reference, tiles
from lora_kernels.expand_kernels import launch_expand
from lora_kernels.meta import LoRABatchMeta
from lora_kernels.shrink_kernels import launch_shrink


def _resolve(device: torch.device, backend: str, path: str, num_tokens: int) -> tuple[str, str]:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if path not in ("auto", *tiles.PATHS):
        raise ValueError(f"path must be 'auto', 'gathered' or 'segmented', got {path!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not tiles.interpreting():
        raise ValueError(
            "the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before importing triton"
        )
    path = tiles.choose_path(num_tokens) if path == "auto" else path
    if backend == "triton" and path == "gathered" and num_tokens > tiles.MAX_GRID_TOKENS:
        raise ValueError(
            f"the gathered path takes at most {tiles.MAX_GRID_TOKENS} tokens; use path='segmented'"
        )
    return backend, path


def _meta_for(meta: LoRABatchMeta | None, token_slots: torch.Tensor, num_slots: int) -> LoRABatchMeta:
    if meta is None:
        return LoRABatchMeta.build(token_slots, num_slots)
    if meta.num_tokens != token_slots.numel() or meta.num_slots != num_slots:
        raise ValueError(
            f"meta was updated for {meta.num_tokens} tokens and {meta.num_slots} slots, but this call has "
            f"{token_slots.numel()} tokens and {num_slots} slots; call meta.update(token_slots) first"
        )
    return meta


def _check_devices(device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}, found one on {t.device}")


def _as_slices(t: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t] if isinstance(t, torch.Tensor) else list(t)


def add_lora_multi(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place; rows may be strided
    x: torch.Tensor,  # [num_tokens, in]
    lora_as: Sequence[torch.Tensor],  # num_slices x [num_slots, max_rank, in]
    lora_bs: Sequence[torch.Tensor],  # num_slices x [num_slots, output_slices[i], max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int32, -1 (NO_LORA): no adapter
    scales: Sequence[torch.Tensor],  # num_slices x [num_slots] float32
    output_slices: Sequence[int],  # widths of y's consecutive column slices (q, k, v or gate, up)
    *,
    slot_ranks: torch.Tensor | None = None,  # [num_slots] int32, ranks <= max_rank; skips the zero tail
    meta: LoRABatchMeta | None = None,
    path: str = "auto",
    backend: str = "auto",
    validate: bool = False,  # check slot values too (a host sync; always done on the CPU)
) -> torch.Tensor:
    """`y[:, slice i] += scales[i][s] * (x @ lora_as[i][s].T) @ lora_bs[i][s].T` per token slot s.

    One shrink launch and one expand launch serve every slice of a fused projection.
    """
    lora_as, lora_bs, scales = list(lora_as), list(lora_bs), list(scales)
    output_slices = [int(w) for w in output_slices]
    checks.check_output(y, sum(output_slices))
    checks.check_activations(x, y.shape[0])
    if y.dtype != x.dtype:
        raise ValueError(f"y has dtype {y.dtype} but x has {x.dtype}; they must agree")
    if not (len(lora_as) == len(lora_bs) == len(scales) == len(output_slices)):
        raise ValueError("lora_as, lora_bs, scales and output_slices must have one entry per slice")
    num_slots, max_rank = checks.check_weights(lora_as, lora_bs, output_slices, x.dtype, x.shape[1])
    _check_devices(x.device, [y, *lora_as, *lora_bs])
    checks.check_slots(token_slots, scales, slot_ranks, x.shape[0], num_slots, max_rank, x.device, validate)
    backend, path = _resolve(x.device, backend, path, x.shape[0])
    if backend == "torch":
        return reference.add_lora_multi(
            y, x, lora_as, lora_bs, token_slots, scales, output_slices, slot_ranks
        )
    if x.shape[0] == 0:
        return y
    meta = _meta_for(meta, token_slots, num_slots) if path == "segmented" else meta
    num_tokens, num_slices = x.shape[0], len(lora_as)
    conf = tiles.launch_configs(
        path, num_tokens, num_slots, num_slices, x.shape[1], max_rank, x.dtype, x.device
    )
    # Padded tokens keep h's strides divisible by 16 for every batch size (one compiled variant).
    shape = (conf.shrink.split_k, num_slices, tiles.padded_tokens(num_tokens), max_rank)
    h = torch.empty(shape, dtype=torch.float32, device=x.device)[:, :, :num_tokens]
    launch_shrink(h, x, lora_as, token_slots, slot_ranks, meta, path, conf.shrink)
    launch_expand(y, h, lora_bs, scales, token_slots, slot_ranks, output_slices, meta, path, conf.expand)
    return y


def add_lora(
    y: torch.Tensor,  # [num_tokens, out], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, max_rank, in]
    lora_b: torch.Tensor,  # [num_slots, out, max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int32, -1: no adapter
    scales: torch.Tensor,  # [num_slots] float32
    *,
    slot_ranks: torch.Tensor | None = None,
    meta: LoRABatchMeta | None = None,
    path: str = "auto",
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """In place, `y[t] += scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T` for `s = token_slots[t] >= 0`."""
    if y.dim() != 2:
        raise ValueError(f"y must be 2-D [num_tokens, out], got shape {tuple(y.shape)}")
    return add_lora_multi(
        y,
        x,
        [lora_a],
        [lora_b],
        token_slots,
        [scales],
        [y.shape[1]],
        slot_ranks=slot_ranks,
        meta=meta,
        path=path,
        backend=backend,
        validate=validate,
    )


def shrink(
    h: torch.Tensor,  # [num_slices, num_tokens, max_rank] (or [num_tokens, max_rank]) float32, overwritten
    x: torch.Tensor,  # [num_tokens, in]
    lora_as: torch.Tensor | Sequence[torch.Tensor],  # (num_slices x) [num_slots, max_rank, in]
    token_slots: torch.Tensor,  # [num_tokens] int32
    *,
    slot_ranks: torch.Tensor | None = None,
    meta: LoRABatchMeta | None = None,
    path: str = "auto",
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """`h[i, t] = x[t] @ lora_as[i][s].T`; every row written, zeros for -1 tokens and past a slot's rank."""
    lora_as = _as_slices(lora_as)
    checks.check_activations(x)
    num_slots, max_rank = checks.check_weights(lora_as, None, None, x.dtype, x.shape[1])
    h3 = checks.check_h(h, len(lora_as), x.shape[0], max_rank)
    _check_devices(x.device, [h, *lora_as])
    checks.check_slots(token_slots, None, slot_ranks, x.shape[0], num_slots, max_rank, x.device, validate)
    backend, path = _resolve(x.device, backend, path, x.shape[0])
    if backend == "torch":
        h3.copy_(reference.shrink(x, lora_as, token_slots, slot_ranks))
        return h
    if x.shape[0] == 0:
        return h
    meta = _meta_for(meta, token_slots, num_slots) if path == "segmented" else meta
    rows, block_m = (x.shape[0], 0) if path == "gathered" else (meta.num_tiles, meta.block_m)
    conf = tiles.shrink_config(path, rows, len(lora_as), x.shape[1], max_rank, x.dtype, x.device, block_m)
    if conf.split_k == 1:
        launch_shrink(h3.unsqueeze(0), x, lora_as, token_slots, slot_ranks, meta, path, conf)
    else:
        partials = torch.empty((conf.split_k, *h3.shape), dtype=torch.float32, device=x.device)
        launch_shrink(partials, x, lora_as, token_slots, slot_ranks, meta, path, conf)
        torch.sum(partials, dim=0, out=h3)
    return h


def expand(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place
    h: torch.Tensor,  # [num_slices, num_tokens, max_rank] (or [num_tokens, max_rank]) float32
    lora_bs: torch.Tensor | Sequence[torch.Tensor],  # (num_slices x) [num_slots, output_slices[i], max_rank]
    token_slots: torch.Tensor,  # [num_tokens] int32
    scales: torch.Tensor | Sequence[torch.Tensor],  # (num_slices x) [num_slots] float32
    *,
    slot_ranks: torch.Tensor | None = None,
    meta: LoRABatchMeta | None = None,
    path: str = "auto",
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """In place, `y[t, slice i] += scales[i][s] * h[i, t] @ lora_bs[i][s].T` for `s = token_slots[t] >= 0`."""
    lora_bs, scales = _as_slices(lora_bs), _as_slices(scales)
    if y.dim() != 2 or y.dtype not in checks.SUPPORTED_DTYPES:
        raise ValueError(f"y must be 2-D float16, bfloat16 or float32, got {y.dtype} {tuple(y.shape)}")
    if len(scales) != len(lora_bs):
        raise ValueError(f"got {len(lora_bs)} lora_b tensors but {len(scales)} scales")
    output_slices = [b.shape[1] if b.dim() == 3 else -1 for b in lora_bs]
    num_slots, max_rank = checks.check_weights(None, lora_bs, output_slices, y.dtype, None)
    checks.check_output(y, sum(output_slices))
    h3 = checks.check_h(h, len(lora_bs), y.shape[0], max_rank)
    _check_devices(y.device, [h, *lora_bs])
    checks.check_slots(token_slots, scales, slot_ranks, y.shape[0], num_slots, max_rank, y.device, validate)
    backend, path = _resolve(y.device, backend, path, y.shape[0])
    if backend == "torch":
        return reference.expand(y, h3, lora_bs, token_slots, scales, slot_ranks)
    if y.shape[0] == 0:
        return y
    meta = _meta_for(meta, token_slots, num_slots) if path == "segmented" else meta
    conf = tiles.expand_config(path, max_rank, y.dtype, y.device, 0 if meta is None else meta.block_m)
    launch_expand(
        y, h3.unsqueeze(0), lora_bs, scales, token_slots, slot_ranks, output_slices, meta, path, conf
    )
    return y


def add_lora_paged(
    y: torch.Tensor,  # [num_tokens, sum(output_slices)], updated in place; rows may be strided
    x: torch.Tensor,  # [num_tokens, in]
    pool_as: Sequence[torch.Tensor],  # num_slices x [num_pages, page, in]: A in pages of `page` rank rows
    pool_bs: Sequence[torch.Tensor],  # num_slices x [num_pages, output_slices[i], page]: B, ranks innermost
    page_table: torch.Tensor,  # [num_slots, max_pages] int32: slot s's rank row r is in page_table[s, r // page]
    token_slots: torch.Tensor,  # [num_tokens] int32, -1 (NO_LORA): no adapter
    scales: Sequence[torch.Tensor],  # num_slices x [num_slots] float32
    output_slices: Sequence[int],
    slot_ranks: torch.Tensor,  # [num_slots] int32: rows read per slot; pages past them are never touched
    *,
    rank_buckets: Sequence[int] | None = None,  # ascending kernel ranks, multiples of the page: see below
    dora_scales: torch.Tensor | None = None,  # [num_slots, sum(output_slices)] float32, unit column stride
    dora_slots: torch.Tensor | None = None,  # [num_slots] int32: nonzero where dora_scales applies
    meta: LoRABatchMeta | None = None,
    path: str = "auto",
    backend: str = "auto",
    validate: bool = False,  # check slot, rank and page values too (a host sync; always done on the CPU)
) -> torch.Tensor:
    """`add_lora_multi` over adapters kept in pages: an adapter of rank r holds ceil(r / page) pages, so
    memory follows each adapter's rank instead of the largest one (engine/lora/pool.py lays them out).

    With `dora_scales` and `dora_slots` (DoRA), a token of a slot s with `dora_slots[s] != 0` gets
    `y[t] = (y[t] + update) * dora_scales[s]` instead, in the same expand kernel (its epilogue): the
    column-wise magnitude / weight-norm factor of each DoRA adapter (engine/lora/dora.py computes it).

    Pages need not be contiguous; the kernels read a slot's page ids once per program, before the K loop.
    As `add_lora` needs B zero past each rank, B must be zero past a slot's rank up to the end of its
    last page (the kernels read B in whole pages); A past the rank is never read.

    The kernels are sized for the largest rank they may meet (h's width, the register tiles), so a rank-8
    token costs in a kernel for rank 64 several times what it costs in one for rank 16. `rank_buckets`
    sizes them to the ranks present: `(16,)` launches kernels for rank 16 only (every token's slot rank
    must be at most 16); `(16, 64)` launches one pair for the tokens whose slot rank is in [0, 16] and
    one for those in (16, 64], each sized to its bucket. None: one pair sized to the page table's width.
    """
    plan = plan_paged(
        y,
        x,
        pool_as,
        pool_bs,
        page_table,
        token_slots,
        scales,
        output_slices,
        slot_ranks,
        rank_buckets=rank_buckets,
        dora_scales=dora_scales,
        dora_slots=dora_slots,
        meta=meta,
        path=path,
        backend=backend,
        validate=validate,
    )
    return run_paged(plan, y, x, pool_as, pool_bs, page_table, scales, slot_ranks, dora_scales, dora_slots)


@dataclass(frozen=True)
class PagedPlan:
    """What `add_lora_paged`'s checks decided for one call's shapes: the backend, the kernels' path, and
    per rank window its launch configs and h buffer. A caller that makes the same call again with
    tensors of the same shapes, dtypes, strides and devices (the same projections of another layer, in
    the same step) passes it to `run_paged` and skips the checks: the engine's mixed steps make dozens
    of such calls (engine/lora/context.py)."""

    backend: str
    path: str
    token_slots: torch.Tensor  # [num_tokens] int32, the step's
    output_slices: tuple[int, ...]
    meta: LoRABatchMeta | None
    # (rank_lo, rank_hi, launch configs, h [split_k, num_slices, num_tokens, rank_hi] float32) per window
    windows: tuple[tuple[int | None, int, Any, torch.Tensor], ...]
    page: int


def plan_paged(
    y: torch.Tensor,
    x: torch.Tensor,
    pool_as: Sequence[torch.Tensor],
    pool_bs: Sequence[torch.Tensor],
    page_table: torch.Tensor,
    token_slots: torch.Tensor,
    scales: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    slot_ranks: torch.Tensor,
    *,
    rank_buckets: Sequence[int] | None = None,
    dora_scales: torch.Tensor | None = None,
    dora_slots: torch.Tensor | None = None,
    meta: LoRABatchMeta | None = None,
    path: str = "auto",
    backend: str = "auto",
    validate: bool = False,
) -> PagedPlan:
    """Every check of `add_lora_paged` (the same arguments), and what its launches need."""
    pool_as, pool_bs, scales = list(pool_as), list(pool_bs), list(scales)
    output_slices = tuple(int(w) for w in output_slices)
    checks.check_output(y, sum(output_slices))
    checks.check_activations(x, y.shape[0])
    if y.dtype != x.dtype:
        raise ValueError(f"y has dtype {y.dtype} but x has {x.dtype}; they must agree")
    if not (len(pool_as) == len(pool_bs) == len(scales) == len(output_slices)):
        raise ValueError("pool_as, pool_bs, scales and output_slices must have one entry per slice")
    num_slots, max_rank = checks.check_pages(pool_as, pool_bs, output_slices, page_table, x.dtype, x.shape[1])
    _check_devices(x.device, [y, *pool_as, *pool_bs, page_table])
    checks.check_slots(token_slots, scales, slot_ranks, x.shape[0], num_slots, max_rank, x.device, validate)
    page = pool_as[0].shape[1]
    windows = rank_windows(rank_buckets, page, max_rank)
    if validate or x.device.type == "cpu":
        checks.check_page_values(page_table, slot_ranks, page, pool_as[0].shape[0])
        if rank_buckets is not None:
            checks.check_bucket_ranks(token_slots, slot_ranks, windows[-1][1])
    checks.check_dora(dora_scales, dora_slots, num_slots, sum(output_slices), x.device)
    backend, path = _resolve(x.device, backend, path, x.shape[0])
    planned = []
    num_tokens, num_slices = x.shape[0], len(pool_as)
    if backend == "triton" and num_tokens:
        meta = _meta_for(meta, token_slots, num_slots) if path == "segmented" else meta
        for rank_lo, rank_hi in windows:
            conf = tiles.launch_configs(
                path, num_tokens, num_slots, num_slices, x.shape[1], rank_hi, x.dtype, x.device
            )
            shape = (conf.shrink.split_k, num_slices, tiles.padded_tokens(num_tokens), rank_hi)
            h = torch.empty(shape, dtype=torch.float32, device=x.device)[:, :, :num_tokens]
            planned.append((rank_lo, rank_hi, conf, h))
    return PagedPlan(backend, path, token_slots, output_slices, meta, tuple(planned), page)


def run_paged(
    plan: PagedPlan,
    y: torch.Tensor,
    x: torch.Tensor,
    pool_as: Sequence[torch.Tensor],
    pool_bs: Sequence[torch.Tensor],
    page_table: torch.Tensor,
    scales: Sequence[torch.Tensor],
    slot_ranks: torch.Tensor,
    dora_scales: torch.Tensor | None = None,
    dora_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """`add_lora_paged` as `plan` decided, without its checks: the tensors must match the planned call's
    in shape, dtype, strides and device (each window's h is reused: calls run one after the other)."""
    dora = None if dora_scales is None else (dora_scales, dora_slots)
    if plan.backend == "torch":
        return reference.add_lora_paged(
            y, x, pool_as, pool_bs, page_table, plan.token_slots, scales, plan.output_slices, slot_ranks, dora
        )
    for rank_lo, rank_hi, conf, h in plan.windows:
        table = page_table[:, : rank_hi // plan.page]  # MAX_RANK of the kernels: this bucket's rank
        launch_shrink(
            h, x, pool_as, plan.token_slots, slot_ranks, plan.meta, plan.path, conf.shrink, table, rank_lo
        )
        launch_expand(
            y,
            h,
            pool_bs,
            scales,
            plan.token_slots,
            slot_ranks,
            plan.output_slices,
            plan.meta,
            plan.path,
            conf.expand,
            table,
            rank_lo,
            dora,
        )
    return y


def rank_windows(
    rank_buckets: Sequence[int] | None, page: int, max_rank: int
) -> list[tuple[int | None, int]]:
    """(rank_lo, rank_hi) of each launch pair: rank_lo None for a single bucket (no window: every token);
    else -1 for the first bucket, so it also takes the slots of rank 0 (untargeted here)."""
    if rank_buckets is None:
        return [(None, max_rank)]
    buckets = [int(b) for b in rank_buckets]
    if not buckets or any(b <= 0 or b % page for b in buckets) or buckets != sorted(set(buckets)):
        raise ValueError(
            f"rank_buckets must be ascending positive multiples of the page ({page} ranks), got {list(rank_buckets)}"
        )
    if buckets[-1] > max_rank:
        raise ValueError(f"rank bucket {buckets[-1]} is above the page table's {max_rank} ranks")
    if len(buckets) == 1:
        return [(None, buckets[0])]
    return list(zip([-1, *buckets[:-1]], buckets))
