"""Argument checks of the host wrappers: shapes, dtypes, layout, and (when asked) slot values.

Shape, dtype and layout checks read only tensor metadata, so they are always on. Checking slot *values*
reads the tensors back to the host, a sync that would break CUDA-graph capture and stall the decode loop,
so it runs only with `validate=True` or on the CPU. On CUDA without it, a slot outside [-1, num_slots)
reads out of bounds: undefined behaviour, as in any gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SLICES = 3  # q/k/v is the widest fused projection
MAX_RANK = 256


def _fail(message: str) -> None:
    raise ValueError(message)


def check_activations(x: torch.Tensor, num_tokens: int | None = None) -> None:
    """x: [num_tokens, in], contiguous, of a supported dtype."""
    if x.dim() != 2:
        _fail(f"x must be 2-D [num_tokens, in], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        _fail(f"x has dtype {x.dtype}; supported: float16, bfloat16, float32")
    if not x.is_contiguous():
        _fail("x must be contiguous; call .contiguous() first")
    if num_tokens is not None and x.shape[0] != num_tokens:
        _fail(f"x has {x.shape[0]} rows but y has {num_tokens}")


def check_output(y: torch.Tensor, num_columns: int) -> None:
    """y: [num_tokens, num_columns] with unit column stride (a column view of a wider tensor is fine)."""
    if y.dim() != 2:
        _fail(f"y must be 2-D [num_tokens, out], got shape {tuple(y.shape)}")
    if y.shape[1] != num_columns:
        _fail(f"y has {y.shape[1]} columns but the output slices sum to {num_columns}")
    if y.shape[1] > 1 and y.stride(1) != 1:
        _fail(f"y must have unit column stride, got strides {y.stride()}; pass a row-major tensor or view")


def check_weights(
    lora_as: Sequence[torch.Tensor] | None,  # num_slices x [num_slots, max_rank, in]
    lora_bs: Sequence[torch.Tensor] | None,  # num_slices x [num_slots, output_slices[i], max_rank]
    output_slices: Sequence[int] | None,
    dtype: torch.dtype,
    in_features: int | None,
) -> tuple[int, int]:
    """Check the stacked adapter weights; returns (num_slots, max_rank)."""
    groups = [("lora_a", t) for t in lora_as or ()] + [("lora_b", t) for t in lora_bs or ()]
    num_slices = len(lora_as if lora_as is not None else lora_bs)
    if not 1 <= num_slices <= MAX_SLICES:
        _fail(f"between 1 and {MAX_SLICES} slices are supported, got {num_slices}")
    if lora_as is not None and lora_bs is not None and len(lora_as) != len(lora_bs):
        _fail(f"got {len(lora_as)} lora_a tensors but {len(lora_bs)} lora_b tensors")
    for name, t in groups:
        if t.dim() != 3:
            _fail(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if t.dtype != dtype:
            _fail(f"{name} has dtype {t.dtype} but x/y have {dtype}; cast the adapter weights")
        if not _dense_slots(t):
            _fail(
                f"{name} must be contiguous within each slot (strides (>= {t[0].numel()}, {t.shape[2]}, 1), "
                f"got {t.stride()}); call .contiguous() first"
            )
    first = groups[0][1]
    num_slots = first.shape[0]
    max_rank = first.shape[1] if groups[0][0] == "lora_a" else first.shape[2]
    if not 1 <= max_rank <= MAX_RANK:
        _fail(f"max_rank must be in [1, {MAX_RANK}], got {max_rank}")
    for t in lora_as or ():
        if tuple(t.shape) != (num_slots, max_rank, in_features):
            _fail(
                f"lora_a must be [num_slots, max_rank, in] = {(num_slots, max_rank, in_features)}, got {tuple(t.shape)}"
            )
    for t, width in zip(lora_bs or (), output_slices or ()):
        if tuple(t.shape) != (num_slots, width, max_rank):
            _fail(
                f"lora_b must be [num_slots, out_slice, max_rank] = {(num_slots, width, max_rank)}, got {tuple(t.shape)}"
            )
    return num_slots, max_rank


def _dense_slots(t: torch.Tensor) -> bool:
    """Each slot's [rows, cols] block is row-major and blocks do not overlap: a dense stack, or slot
    views into a larger pool (the engine keeps each slot's whole adapter in one block, engine/lora/slots.py)."""
    rows, cols = t.shape[1], t.shape[2]
    row_major = (cols <= 1 or t.stride(2) == 1) and (rows <= 1 or t.stride(1) == cols)
    return row_major and (t.shape[0] <= 1 or t.stride(0) >= rows * cols)


def check_h(h: torch.Tensor, num_slices: int, num_tokens: int, max_rank: int) -> torch.Tensor:
    """h: contiguous float32 [num_slices, num_tokens, max_rank] ([num_tokens, max_rank] for one slice);
    returns the 3-D view."""
    h3 = h if h.dim() == 3 else h.unsqueeze(0)
    if (
        h.dtype != torch.float32
        or tuple(h3.shape) != (num_slices, num_tokens, max_rank)
        or not h.is_contiguous()
    ):
        _fail(
            f"h must be contiguous float32 {[num_slices, num_tokens, max_rank]}, got {h.dtype} {tuple(h.shape)}"
        )
    return h3


def check_slots(
    token_slots: torch.Tensor,  # [num_tokens] int32
    scales: Sequence[torch.Tensor] | None,  # num_slices x [num_slots] float32
    slot_ranks: torch.Tensor | None,  # [num_slots] int32
    num_tokens: int,
    num_slots: int,
    max_rank: int,
    device: torch.device,
    validate: bool,
) -> None:
    """Metadata checks always; value checks (a host sync) only with `validate` or on the CPU."""
    if token_slots.dtype != torch.int32 or token_slots.dim() != 1 or token_slots.numel() != num_tokens:
        _fail(
            f"token_slots must be a 1-D int32 tensor of {num_tokens} entries, got {token_slots.dtype} of "
            f"shape {tuple(token_slots.shape)}; use .to(torch.int32)"
        )
    for s in scales or ():
        if s.dtype != torch.float32 or tuple(s.shape) != (num_slots,) or not s.is_contiguous():
            _fail(
                f"scales must be contiguous float32 [num_slots] = [{num_slots}], got {s.dtype} of shape "
                f"{tuple(s.shape)} and strides {s.stride()}"
            )
    if slot_ranks is not None and (
        slot_ranks.dtype != torch.int32
        or tuple(slot_ranks.shape) != (num_slots,)
        or not slot_ranks.is_contiguous()
    ):
        _fail(
            f"slot_ranks must be contiguous int32 [num_slots] = [{num_slots}], got {slot_ranks.dtype} "
            f"{tuple(slot_ranks.shape)} with strides {slot_ranks.stride()}"
        )
    tensors = [token_slots, *(scales or ()), *([slot_ranks] if slot_ranks is not None else [])]
    for t in tensors:
        if t.device != device:
            _fail(f"all tensors must be on {device}, found one on {t.device}")
    if not (validate or device.type == "cpu"):
        return
    if num_tokens and ((token_slots < -1) | (token_slots >= num_slots)).any():
        bad = token_slots[(token_slots < -1) | (token_slots >= num_slots)][0].item()
        _fail(f"token_slots holds {bad}; slots must be in [-1, {num_slots}) (-1: no adapter)")
    if slot_ranks is not None and ((slot_ranks < 0) | (slot_ranks > max_rank)).any():
        _fail(f"slot_ranks must be in [0, max_rank={max_rank}]")


def check_pages(
    pool_as: Sequence[torch.Tensor],  # num_slices x [num_pages, page, in]
    pool_bs: Sequence[torch.Tensor],  # num_slices x [num_pages, output_slices[i], page]
    output_slices: Sequence[int],
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    dtype: torch.dtype,
    in_features: int,
) -> tuple[int, int]:
    """Check a paged pool of adapter weights; returns (num_slots, max_rank = max_pages * page)."""
    if not 1 <= len(pool_as) <= MAX_SLICES or len(pool_as) != len(pool_bs):
        _fail(f"between 1 and {MAX_SLICES} slices with one pool_a and one pool_b each are supported")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.stride(1) != 1:
        _fail(
            f"page_table must be an int32 [num_slots, max_pages] tensor with unit column stride, got "
            f"{page_table.dtype} {tuple(page_table.shape)} strides {page_table.stride()}"
        )
    page = pool_as[0].shape[1] if pool_as[0].dim() == 3 else 0
    num_slots, max_rank = page_table.shape[0], page_table.shape[1] * page
    for t in pool_as:
        _check_pages_of(t, "pool_a", (page, in_features), dtype)
    for t, width in zip(pool_bs, output_slices):
        _check_pages_of(t, "pool_b", (width, page), dtype)
    if len({t.shape[0] for t in (*pool_as, *pool_bs)}) != 1:
        _fail("every pool_a and pool_b must hold the same number of pages (one page id addresses them all)")
    if not 1 <= max_rank <= MAX_RANK:
        _fail(f"max_pages * page must be in [1, {MAX_RANK}], got {max_rank}")
    return num_slots, max_rank


def _check_pages_of(t: torch.Tensor, name: str, page_shape: tuple[int, int], dtype: torch.dtype) -> None:
    """One pool of row-major pages, each `page_shape` (A: [page, in]; B: [out, page])."""
    rows, cols = page_shape
    if t.dim() != 3 or tuple(t.shape[1:]) != page_shape:
        _fail(f"{name} must be [num_pages, {rows}, {cols}], got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(f"{name} has dtype {t.dtype} but x/y have {dtype}; cast the adapter weights")
    if t.stride(2) != 1 or t.stride(1) != cols or t.stride(0) < rows * cols:
        _fail(f"{name} must hold row-major pages (strides (>= {rows * cols}, {cols}, 1)), got {t.stride()}")


def check_page_values(page_table: torch.Tensor, slot_ranks: torch.Tensor, page: int, num_pages: int) -> None:
    """Every page a slot's rank reaches lies in the pool (a host sync: with `validate` or on the CPU)."""
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] * page < slot_ranks[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bad.any():
        slot = int(bad.nonzero()[0, 0])
        _fail(f"page_table row {slot} points outside the pool's {num_pages} pages for its rank")


def check_bucket_ranks(token_slots: torch.Tensor, slot_ranks: torch.Tensor, top: int) -> None:
    """Every token's slot rank fits the largest rank bucket (a host sync: the CPU, or validate=True)."""
    used = token_slots[token_slots >= 0].long()
    if used.numel() and int(slot_ranks[used].max()) > top:
        _fail(f"a token's slot has rank {int(slot_ranks[used].max())}, above the largest rank bucket {top}")
