"""Logits of the rows whose adapter owns an LM head: `logits[row] = hidden[row] @ heads[head]^T` over the
vocabulary, for adapters with `modules_to_save` lm_head or LoRA merged into it (engine/lora/vocab.py).
Rows without a head of their own keep what `logits` holds (the base head's logits).

Static shapes, so a decode step's CUDA graph can hold it: the rows are grouped by head on the device (a
stable sort of each row's head index, rows without one last, and each head's [start, end) by a binary
search), nothing is read back to the host, and the grid is (heads in the pool, vocabulary tiles) whatever
the step holds. A program whose head no row uses exits after loading its two bounds, so a step reads only
the heads its rows use, each tile once per BLOCK_M of its rows. Example, 5 rows, pool slots 0 and 3 own
heads 0 and 1, slot 5 is a plain adapter:

    row_slots  = [3, -1, 0, 3, 5]
    slot_heads = [0, -1, -1, 1, -1, -1]         per pool slot: its head, or -1
    keys       = [1, 2, 0, 1, 2]                2 (= number of heads): no head of its own
    order      = [2, 0, 3, 1, 4]   bounds = [0, 1, 3]: head 0 computes row 2, head 1 rows 0 and 3

`backend="auto"` runs the kernel on CUDA tensors and under TRITON_INTERPRET=1 (the CPU tests, which then
run the code a graph captures), and a plain torch loop over the heads elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lora_kernels.tiles import interpreting

BLOCK_M = 16  # rows of one head per tile: tl.dot's least; decode steps hold a few rows per adapter
BLOCK_N = 128  # vocabulary columns per program (a 128 x BLOCK_K head tile streams per step of K)


@triton.jit
def _own_head_kernel(
    logits_ptr,  # [rows, vocab]
    hidden_ptr,  # [rows, hidden]
    heads_ptr,  # [num_heads, vocab, hidden]
    order_ptr,  # [rows] int64: row ids grouped by head
    bounds_ptr,  # [num_heads + 1] int64: head h's rows are order[bounds[h]:bounds[h + 1]]
    vocab,
    hidden_size,
    stride_logits,
    stride_hidden,
    stride_head,
    stride_head_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,  # cdiv(hidden_size, BLOCK_K), fixed per model
    DOT_FP32: tl.constexpr,  # fp32 inputs, or the interpreter (whose bf16 tl.dot is wrong)
):
    head = tl.program_id(0)
    start = tl.load(bounds_ptr + head)
    end = tl.load(bounds_ptr + head + 1)
    if start >= end:  # no row of this step uses this head
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < vocab
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = heads_ptr + head.to(tl.int64) * stride_head + offs_n[:, None].to(tl.int64) * stride_head_row
    m0 = start
    while m0 < end:  # (a while: the interpreter's range() takes no loaded bounds)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < end
        rows = tl.load(order_ptr + offs_m, mask=m_ok, other=0)
        x_rows = hidden_ptr + rows[:, None] * stride_hidden
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(K_ITERS):  # a constexpr count: the interpreter's range() takes no int arguments
            k = i * BLOCK_K + offs_k
            k_ok = k < hidden_size
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        out = logits_ptr + rows[:, None] * stride_logits + offs_n[None, :]
        tl.store(out, acc.to(logits_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
        m0 += BLOCK_M


def own_head_logits(
    logits: torch.Tensor,  # [rows, vocab], written in place on the rows with a head of their own
    hidden: torch.Tensor,  # [rows, hidden]
    heads: torch.Tensor,  # [num_heads, vocab, hidden]
    row_slots: torch.Tensor,  # [rows] int32: each row's pool slot, -1 for none
    slot_heads: torch.Tensor,  # [num_slots] int32: each pool slot's head in `heads`, -1 for none
    backend: str = "auto",
) -> torch.Tensor:
    """Overwrite the logits of the rows whose slot owns a head with `hidden[row] @ heads[head]^T`
    (accumulated in float32, stored in logits' dtype); returns `logits`."""
    _check(logits, hidden, heads, row_slots, slot_heads)
    num_heads = heads.shape[0]
    if hidden.shape[0] == 0 or num_heads == 0:
        return logits
    head = torch.where(row_slots >= 0, slot_heads[row_slots.clamp(min=0).long()], -1)  # [rows]
    keys = torch.where(head >= 0, head, num_heads).long()
    if backend == "auto":
        backend = "triton" if logits.device.type == "cuda" or interpreting() else "torch"
    if backend == "torch":  # host-side loop: never captured
        for h in keys.unique().tolist():
            if h < num_heads:
                rows = (keys == h).nonzero().flatten()
                logits[rows] = F.linear(hidden[rows].float(), heads[h].float()).to(logits.dtype)
        return logits
    if backend != "triton":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(num_heads + 1, device=keys.device))
    vocab, hidden_size = heads.shape[1], heads.shape[2]
    dot_fp32 = hidden.dtype == torch.float32 or interpreting()
    block_k = min(64 if dot_fp32 else 128, max(16, triton.next_power_of_2(hidden_size)))
    _own_head_kernel[(num_heads, triton.cdiv(vocab, BLOCK_N))](
        logits,
        hidden,
        heads,
        order,
        bounds,
        vocab,
        hidden_size,
        logits.stride(0),
        hidden.stride(0),
        heads.stride(0),
        heads.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        K_ITERS=triton.cdiv(hidden_size, block_k),
        DOT_FP32=dot_fp32,
        num_warps=4,
    )
    return logits


def _check(logits, hidden, heads, row_slots, slot_heads) -> None:
    """Shapes and layout (metadata only, so a captured step syncs nothing); slot values on the CPU."""
    if hidden.dim() != 2 or logits.dim() != 2 or heads.dim() != 3:
        raise ValueError(
            f"want logits [rows, vocab], hidden [rows, hidden], heads [num_heads, vocab, hidden]; got "
            f"{tuple(logits.shape)}, {tuple(hidden.shape)}, {tuple(heads.shape)}"
        )
    rows = hidden.shape[0]
    if logits.shape != (rows, heads.shape[1]) or heads.shape[2] != hidden.shape[1]:
        raise ValueError(
            f"logits {tuple(logits.shape)}, hidden {tuple(hidden.shape)} and heads {tuple(heads.shape)} "
            "disagree on rows, vocabulary or hidden size"
        )
    if row_slots.shape != (rows,) or slot_heads.dim() != 1:
        raise ValueError(f"row_slots must be [{rows}] and slot_heads 1-D")
    if row_slots.dtype != torch.int32 or slot_heads.dtype != torch.int32:
        raise ValueError("row_slots and slot_heads must be int32")
    if hidden.stride(1) != 1 or logits.stride(1) != 1 or not heads.is_contiguous():
        raise ValueError("hidden and logits need contiguous rows and heads must be contiguous")
    if hidden.dtype != heads.dtype:
        raise ValueError(f"hidden has dtype {hidden.dtype} but heads have {heads.dtype}")
    devices = {t.device for t in (logits, hidden, heads, row_slots, slot_heads)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if logits.device.type == "cpu" and rows:
        if int(row_slots.min()) < -1 or int(row_slots.max()) >= slot_heads.shape[0]:
            raise ValueError(f"row_slots must lie in [-1, {slot_heads.shape[0]})")
        if int(slot_heads.min()) < -1 or int(slot_heads.max()) >= heads.shape[0]:
            raise ValueError(f"slot_heads must lie in [-1, {heads.shape[0]})")
