"""Random paged grouped-LoRA problems: adapters of mixed ranks scattered over a pool of rank pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_kernels import reference

POISON_PAGE = 1 << 30  # page-table entries past a slot's rank: out of bounds if anything read them


@dataclass
class PagedCase:
    x: torch.Tensor  # [num_tokens, in]
    y: torch.Tensor  # [num_tokens, sum(out_slices)], random
    pool_as: list[
        torch.Tensor
    ]  # num_slices x [num_pages, page, in]; rows nobody owns and rows past a rank: NaN
    pool_bs: list[torch.Tensor]  # num_slices x [num_pages, out_slice, page]; pages nobody owns: NaN
    page_table: torch.Tensor  # [num_slots, max_pages] int32, POISON_PAGE past each slot's pages
    token_slots: torch.Tensor  # [num_tokens] int32
    scales: list[torch.Tensor]  # num_slices x [num_slots] float32
    slot_ranks: torch.Tensor  # [num_slots] int32
    dense_as: list[torch.Tensor]  # num_slices x [num_slots, max_rank, in], zero past each rank
    dense_bs: list[torch.Tensor]  # num_slices x [num_slots, out_slice, max_rank], likewise

    def expected(self) -> torch.Tensor:
        """y + the LoRA delta in float64, from the dense copies of the same (rounded) weights."""
        return reference.add_lora_multi(
            self.y.double().clone(),
            self.x.double(),
            [a.double() for a in self.dense_as],
            [b.double() for b in self.dense_bs],
            self.token_slots,
            [s.double() for s in self.scales],
            [b.shape[1] for b in self.dense_bs],
        )


def make_paged_case(
    seed: int,
    num_tokens: int,
    in_features: int,
    out_slices: list[int],
    ranks: list[int],  # one per slot
    page: int,
    dtype: torch.dtype,
    device: str = "cpu",
    spare_pages: int = 3,
) -> PagedCase:
    """Slots get their pages in a random order from a pool with `spare_pages` pages nobody owns."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, max_rank = len(ranks), max(ranks)
    max_pages = -(-max_rank // page)
    needed = [-(-r // page) for r in ranks]
    num_pages = sum(needed) + spare_pages
    order = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((num_slots, max_pages), POISON_PAGE, dtype=torch.int32)
    nan = float("nan")
    pool_as = [torch.full((num_pages, page, in_features), nan, dtype=dtype) for _ in out_slices]
    pool_bs = [torch.full((num_pages, w, page), nan, dtype=dtype) for w in out_slices]
    dense_as = [torch.zeros(num_slots, max_rank, in_features, dtype=dtype) for _ in out_slices]
    dense_bs = [torch.zeros(num_slots, w, max_rank, dtype=dtype) for w in out_slices]
    for slot, rank in enumerate(ranks):
        pages = [order.pop() for _ in range(needed[slot])]
        page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for i, width in enumerate(out_slices):
            a = (torch.randn(rank, in_features, generator=gen) * in_features**-0.5).to(dtype)
            bt = (torch.randn(rank, width, generator=gen) * rank**-0.5).to(dtype)
            dense_as[i][slot, :rank], dense_bs[i][slot, :, :rank] = a, bt.T
            for j, p in enumerate(pages):
                rows = slice(j * page, min(rank, (j + 1) * page))
                pool_as[i][p, : rows.stop - rows.start] = a[rows]  # A past the rank stays NaN: never read
                pool_bs[i][p] = 0.0  # B past the rank is zero padding, as in the pool (read in whole pages)
                pool_bs[i][p, :, : rows.stop - rows.start] = bt[rows].T
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    token_slots[: min(num_tokens, num_slots)] = torch.arange(min(num_tokens, num_slots))  # every rank used
    token_slots[-1] = -1
    token_slots = token_slots[torch.randperm(num_tokens, generator=gen)].to(torch.int32)
    scales = [torch.rand(num_slots, generator=gen) * 1.5 + 0.5 for _ in out_slices]
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(num_tokens, sum(out_slices), generator=gen).to(dtype)

    def dev(ts):
        return [t.to(device) for t in ts]

    return PagedCase(
        x=x.to(device),
        y=y.to(device),
        pool_as=dev(pool_as),
        pool_bs=dev(pool_bs),
        page_table=page_table.to(device),
        token_slots=token_slots.to(device),
        scales=dev(scales),
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        dense_as=dev(dense_as),
        dense_bs=dev(dense_bs),
    )
