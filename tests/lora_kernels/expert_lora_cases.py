"""Random expert-LoRA problems (lora_kernels/expert_kernels.py) laid out as the pool lays them out, and
their float64 reference: one layer's A [num_pages, E, PAGE_RANK, in] and B [num_pages, E, out, PAGE_RANK]
as strided views of a page buffer with other data around them, adapters of several ranks on pages in
shuffled order (ranks below the page size leave rows of their last page to be ignored), page-table
entries past an adapter's pages out of range (a kernel that addresses through one fails), base-model
tokens, and pairs of experts another rank holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_RANK = 8
STALE_PAGE = 1 << 20  # page-table entries past an adapter's pages: never a valid page


@dataclass
class ExpertLoRACase:
    x: torch.Tensor  # [rows, in]: tokens, or pairs when per_pair_input
    lora_a: torch.Tensor  # [num_pages, E, PAGE_RANK, in] strided view
    lora_b: torch.Tensor  # [num_pages, E, out, PAGE_RANK] strided view
    page_table: torch.Tensor  # [max_loras, max_pages] int32
    token_slots: torch.Tensor  # [num_tokens] int32, -1: base model
    local_ids: torch.Tensor  # [num_tokens * top_k] int64, num_local: another rank's expert
    scales: torch.Tensor  # [max_loras] float32
    ranks: torch.Tensor  # [max_loras] int32
    top_k: int
    num_local: int
    per_pair_input: bool

    def args(self) -> tuple:
        return (
            self.x, self.lora_a, self.lora_b, self.page_table, self.token_slots, self.local_ids,
            self.scales, self.ranks, self.top_k, self.num_local, self.per_pair_input,
        )  # fmt: skip

    def to(self, device, dtype) -> ExpertLoRACase:
        moved = {name: getattr(self, name).to(device) for name in ("page_table", "token_slots", "local_ids")}
        moved.update(scales=self.scales.to(device), ranks=self.ranks.to(device))
        # Views of one moved page buffer, so the strides stay the pool's.
        base = self.lora_a._base if self.lora_a._base is not None else self.lora_a
        buffer = base.to(device, dtype)
        lora_a = buffer.as_strided(self.lora_a.shape, self.lora_a.stride(), self.lora_a.storage_offset())
        lora_b = buffer.as_strided(self.lora_b.shape, self.lora_b.stride(), self.lora_b.storage_offset())
        return ExpertLoRACase(
            self.x.to(device, dtype), lora_a, lora_b, **moved, top_k=self.top_k, num_local=self.num_local,
            per_pair_input=self.per_pair_input,
        )  # fmt: skip

    def expected(self) -> torch.Tensor:  # [num_pairs, out] float64
        a, b, x = self.lora_a.double(), self.lora_b.double(), self.x.double()
        out = torch.zeros(self.local_ids.numel(), b.shape[2], dtype=torch.float64)
        for pair, expert in enumerate(self.local_ids.tolist()):
            slot = int(self.token_slots[pair // self.top_k])
            rank = int(self.ranks[slot]) if slot >= 0 else 0
            if expert >= self.num_local or rank == 0:
                continue
            pages = self.page_table[slot, : -(-rank // PAGE_RANK)].long()
            a_se = a[pages, expert].flatten(0, 1)[:rank]  # [rank, in]
            b_se = b[pages, expert].permute(1, 0, 2).flatten(1)[:, :rank]  # [out, rank]
            row = x[pair if self.per_pair_input else pair // self.top_k]
            out[pair] = b_se @ (float(self.scales[slot]) * (a_se @ row))
        return out


def make_case(
    num_tokens: int,
    in_features: int,
    out_features: int,
    num_experts: int,
    top_k: int,
    slot_ranks: list[int],  # per slot; 0: the adapter does not target this projection
    seed: int,
    per_pair_input: bool = False,
    foreign: bool = True,  # some pairs route to experts another rank holds
    max_rank: int | None = None,
) -> ExpertLoRACase:
    gen = torch.Generator().manual_seed(seed)
    max_rank = max_rank or max(slot_ranks)
    max_pages = -(-max_rank // PAGE_RANK)
    needed = [-(-r // PAGE_RANK) for r in slot_ranks]
    num_pages = sum(needed) + 2  # two pages nobody holds
    a_numel = num_experts * PAGE_RANK * in_features
    b_numel = num_experts * out_features * PAGE_RANK
    page_numel = 5 + a_numel + 3 + b_numel + 7  # other targets' data around this layer's blocks
    pages = torch.randn(num_pages, page_numel, generator=gen)
    lora_a = pages[:, 5 : 5 + a_numel].unflatten(1, (num_experts, PAGE_RANK, in_features))
    lora_b = pages[:, 8 + a_numel : 8 + a_numel + b_numel].unflatten(
        1, (num_experts, out_features, PAGE_RANK)
    )
    page_table = torch.full((len(slot_ranks), max_pages), STALE_PAGE, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=gen).tolist()
    for slot, count in enumerate(needed):
        page_table[slot, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    num_slots = len(slot_ranks)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    token_slots[0] = -1  # always a base-model token
    token_slots[-1] = num_slots - 1
    choices = num_experts + (1 if foreign else 0)
    local_ids = torch.stack([torch.randperm(choices, generator=gen)[:top_k] for _ in range(num_tokens)])
    rows = num_tokens * top_k if per_pair_input else num_tokens
    x = torch.randn(rows, in_features, generator=gen)
    if per_pair_input:  # rows of another rank's pairs: left unwritten by the fused-MoE kernel
        x[local_ids.reshape(-1) >= num_experts] = float("nan")
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return ExpertLoRACase(
        x, lora_a, lora_b, page_table, token_slots, local_ids.reshape(-1),
        scales, torch.tensor(slot_ranks, dtype=torch.int32), top_k, num_experts, per_pair_input,
    )  # fmt: skip
