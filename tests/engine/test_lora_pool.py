"""LoRAPool: an adapter takes the pages its rank needs, lands in exactly its pages and slot, and the
per-layer kernel views read it back."""

from __future__ import annotations

import pytest
import torch

import lora_kernels
from adapter_format.checkpoint import ModuleLoRA, PeftAdapter
from adapter_format.model_shape import TARGET_MODULES, ModelShape
from engine.lora.pool import LoRAPool
from engine.lora.slot_allocator import SlotAllocator
from engine.lora.slots import PAGE_RANK, SlotLayout

SHAPE = ModelShape(
    num_layers=3, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2, head_dim=12
)
MAX_RANK = 64


def random_adapter(seed: int, modules: tuple[str, ...], rank: int, vary: bool = True) -> PeftAdapter:
    """`rank` somewhere, smaller ranks elsewhere when `vary`; only `modules` targeted."""
    gen = torch.Generator().manual_seed(seed)
    pairs = {}
    for layer in range(SHAPE.num_layers):
        for module in modules:
            r = int(torch.randint(1, rank + 1, (1,), generator=gen)) if vary else rank
            in_features, out_features = SHAPE.module_dims(module)
            pairs[layer, module] = ModuleLoRA(
                rank=r,
                scale=float(torch.rand(1, generator=gen)) + 0.5,
                lora_a=torch.randn(r, in_features, generator=gen),
                lora_b=torch.randn(out_features, r, generator=gen),
            )
    first = next(iter(pairs))
    pairs[first] = ModuleLoRA(
        rank,
        1.0,
        torch.randn(rank, SHAPE.module_dims(first[1])[0]),
        torch.randn(SHAPE.module_dims(first[1])[1], rank),
    )
    return PeftAdapter(rank, 16.0, modules, None, pairs)


def assert_slot_holds(pool: LoRAPool, slot: int, adapter: PeftAdapter) -> None:
    held = pool.snapshot(slot)
    lora_a, lora_b = held.lora_a, held.lora_b
    for layer in range(SHAPE.num_layers):
        for module in TARGET_MODULES:
            pair = adapter.modules.get((layer, module))
            rank = 0 if pair is None else pair.rank
            a, b = lora_a[module][layer], lora_b[module][layer]
            assert int(pool.ranks[module][layer, slot]) == rank
            assert float(pool.scales[module][layer, slot]) == pytest.approx(
                0.0 if pair is None else pair.scale
            )
            assert not a[rank:].any() and not b[:, rank:].any(), "zero padding past the rank"
            if pair is not None:
                assert torch.equal(a[:rank], pair.lora_a) and torch.equal(b[:, :rank], pair.lora_b)
        for group in pool.layout.fused_groups:  # the launch groups of this model's targets
            ranks = [int(pool.ranks[m][layer, slot]) for m in group]
            assert int(pool.slot_ranks(layer, group)[slot]) == max(ranks)


@pytest.mark.parametrize("rank", [4, 8, 16, 64])
def test_an_adapter_takes_its_rank_share_of_a_full_slot_within_page_rounding(rank: int) -> None:
    pool = LoRAPool(SHAPE, max_loras=2, max_rank=MAX_RANK, dtype=torch.bfloat16, device=torch.device("cpu"))
    full = pool.image(random_adapter(0, TARGET_MODULES, MAX_RANK)).num_bytes
    image = pool.image(random_adapter(rank, TARGET_MODULES, rank))
    assert image.num_pages == -(-rank // PAGE_RANK)
    assert image.num_bytes == full * image.num_pages * PAGE_RANK // MAX_RANK
    assert rank / MAX_RANK <= image.num_bytes / full < (rank + PAGE_RANK) / MAX_RANK
    # The default pool holds max_loras adapters of max_lora_rank, and nothing more.
    assert pool.weights.numel() * 2 == 2 * full


def test_loaded_images_land_in_their_pages_and_slots_only() -> None:
    pool = LoRAPool(
        SHAPE,
        max_loras=3,
        max_rank=MAX_RANK,
        dtype=torch.float32,
        device=torch.device("cpu"),
        rank_budget=128,
    )
    big = random_adapter(1, TARGET_MODULES, 64)
    small = random_adapter(2, ("q_proj", "v_proj", "o_proj"), 16)
    pool.load(0, pool.image(big), [7, 8, 9, 10, 11, 12, 13, 14])
    pool.load(2, pool.image(big), [0, 1, 2, 3, 4, 15, 5, 6])  # scattered pages load as well
    pool.load(2, pool.image(small), [3, 1])  # replaces the slot; its other pages are no longer read
    assert_slot_holds(pool, 0, big)
    assert_slot_holds(pool, 2, small)
    assert pool.page_table[2, :2].tolist() == [3, 1]
    assert not pool.table[:, :, 1].any(), "slot 1 was never loaded"


@pytest.mark.interpreted
def test_the_kernel_views_read_the_pool_as_the_dense_layout_would() -> None:
    """add_lora_paged over the pool's views equals add_lora_multi over the adapters' dense copies."""
    pool = LoRAPool(SHAPE, max_loras=3, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
    adapters = [
        random_adapter(3, TARGET_MODULES, 64),
        random_adapter(4, TARGET_MODULES, 4),
        random_adapter(5, TARGET_MODULES, 16),
    ]
    allocator = SlotAllocator(3, pool.num_pages)
    for i, adapter in enumerate(adapters):
        image = pool.image(adapter)
        slot, _ = allocator.acquire(str(i), num_pages=image.num_pages)
        pool.load(slot, image, allocator.pages_of(str(i)))
    gen = torch.Generator().manual_seed(6)
    token_slots = torch.tensor([0, 1, -1, 2, 2, 0, 1], dtype=torch.int32)
    layer, group = 1, ("q_proj", "k_proj", "v_proj")
    views = [pool.layers[layer][m] for m in group]
    widths = [SHAPE.module_dims(m)[1] for m in group]
    x = torch.randn(7, SHAPE.hidden_size, generator=gen)
    y = torch.randn(7, sum(widths), generator=gen)
    paged = y.clone()
    lora_kernels.add_lora_paged(
        paged,
        x,
        [v.lora_a for v in views],
        [v.lora_b for v in views],
        pool.page_table,
        token_slots,
        [v.scales for v in views],
        widths,
        pool.slot_ranks(layer, group),
        backend="triton",
    )
    dense = [pool.snapshot(s) for s in range(3)]
    expected = y.double().clone()
    lora_kernels.reference.add_lora_multi(
        expected,
        x.double(),
        [torch.stack([d.lora_a[m][layer] for d in dense]).double() for m in group],
        [torch.stack([d.lora_b[m][layer] for d in dense]).double() for m in group],
        token_slots,
        [v.scales.double() for v in views],
        widths,
    )
    torch.testing.assert_close(paged.double(), expected, rtol=1e-4, atol=1e-4)


def test_views_are_aligned_and_pages_follow_the_layout() -> None:
    pool = LoRAPool(SHAPE, max_loras=4, max_rank=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    layout = SlotLayout(SHAPE, 16)
    assert pool.num_pages == 4 * 2 and pool.weights.shape == (8, layout.page_numel)
    view = pool.layers[1]["down_proj"]
    assert view.lora_a.shape == (8, PAGE_RANK, SHAPE.intermediate_size)
    assert view.lora_a.stride() == (layout.page_numel, SHAPE.intermediate_size, 1)
    assert view.lora_b.shape == (8, SHAPE.hidden_size, PAGE_RANK)  # B, ranks innermost
    assert view.lora_b.stride() == (layout.page_numel, PAGE_RANK, 1)
    assert view.scales.is_contiguous() and view.scales.dtype == torch.float32 and view.ranks.is_contiguous()
    base = pool.weights.data_ptr()
    for layer in pool.layers:
        for v in layer.values():
            assert all((t.data_ptr() - base) % 128 == 0 for t in (v.lora_a, v.lora_b))


def test_bad_slots_ranks_and_budgets_are_refused() -> None:
    pool = LoRAPool(SHAPE, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds max_lora_rank 8"):
        pool.image(PeftAdapter(16, 16.0, ("q_proj",), None, {}))
    image = pool.image(random_adapter(7, ("q_proj",), 8))
    with pytest.raises(ValueError, match="outside"):
        pool.load(2, image, [0])
    with pytest.raises(ValueError, match="fills 1 pages but only 0"):
        pool.load(0, image, [])
    with pytest.raises(ValueError, match="raise lora_pool_rank_budget"):
        LoRAPool(SHAPE, 4, 64, torch.float32, torch.device("cpu"), rank_budget=32)
