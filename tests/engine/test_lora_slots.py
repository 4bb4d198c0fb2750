"""LoRASlots: an adapter's image lands in exactly its slot, and the per-layer views read it back."""

from __future__ import annotations

import pytest
import torch

from adapter_format.checkpoint import ModuleLoRA, PeftAdapter
from adapter_format.model_shape import TARGET_MODULES, ModelShape
from engine.lora.slots import FUSED_PROJECTIONS, LoRASlots

SHAPE = ModelShape(
    num_layers=3, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2, head_dim=12
)
MAX_RANK = 8


def random_adapter(seed: int, modules: tuple[str, ...]) -> PeftAdapter:
    """Mixed ranks per layer and projection, only `modules` targeted."""
    gen = torch.Generator().manual_seed(seed)
    pairs = {}
    for layer in range(SHAPE.num_layers):
        for module in modules:
            rank = int(torch.randint(1, MAX_RANK + 1, (1,), generator=gen))
            in_features, out_features = SHAPE.module_dims(module)
            pairs[layer, module] = ModuleLoRA(
                rank=rank,
                scale=float(torch.rand(1, generator=gen)) + 0.5,
                lora_a=torch.randn(rank, in_features, generator=gen),
                lora_b=torch.randn(out_features, rank, generator=gen),
            )
    return PeftAdapter(max(p.rank for p in pairs.values()), 16.0, modules, None, pairs)


def assert_slot_holds(slots: LoRASlots, slot: int, adapter: PeftAdapter) -> None:
    for layer, views in enumerate(slots.layers):
        for module in TARGET_MODULES:
            pair = adapter.modules.get((layer, module))
            rank = 0 if pair is None else pair.rank
            a, b = views[module].lora_a[slot], views[module].lora_b[slot]
            assert int(views[module].ranks[slot]) == rank
            assert float(views[module].scales[slot]) == pytest.approx(0.0 if pair is None else pair.scale)
            assert not a[rank:].any() and not b[:, rank:].any(), "zero padding past the rank"
            if pair is not None:
                assert torch.equal(a[:rank], pair.lora_a) and torch.equal(b[:, :rank], pair.lora_b)
        for group in FUSED_PROJECTIONS:
            ranks = [int(views[m].ranks[slot]) for m in group]
            assert int(slots.slot_ranks(layer, group)[slot]) == max(ranks)


def test_a_loaded_image_lands_in_its_slot_only() -> None:
    slots = LoRASlots(SHAPE, max_loras=3, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
    everything = random_adapter(1, TARGET_MODULES)
    attention_only = random_adapter(2, ("q_proj", "v_proj", "o_proj"))
    slots.load(0, slots.image(everything))
    slots.load(2, slots.image(everything))
    slots.load(2, slots.image(attention_only))  # replaces every byte of the previous adapter
    assert_slot_holds(slots, 0, everything)
    assert_slot_holds(slots, 2, attention_only)
    assert not slots.weights[1].any() and not slots.table[:, :, 1].any(), "slot 1 was never loaded"


def test_each_slot_is_one_block_and_the_kernel_views_are_per_layer() -> None:
    slots = LoRASlots(SHAPE, max_loras=4, max_rank=MAX_RANK, dtype=torch.bfloat16, device=torch.device("cpu"))
    image = slots.image(random_adapter(3, TARGET_MODULES))
    assert slots.weights[2].is_contiguous() and image.weights.shape == slots.weights[2].shape
    assert image.num_bytes == slots.weights[2].numel() * 2
    view = slots.layers[1]["down_proj"]
    assert view.lora_a.shape == (4, MAX_RANK, SHAPE.intermediate_size)
    assert view.lora_a.stride() == (slots.layout.numel, SHAPE.intermediate_size, 1)
    assert view.scales.is_contiguous() and view.scales.dtype == torch.float32 and view.ranks.is_contiguous()
    base = slots.weights.data_ptr()
    for module in TARGET_MODULES:  # every block starts 128-byte aligned within the pool
        assert all((t.data_ptr() - base) % 128 == 0 for t in (slots.lora_a[module], slots.lora_b[module]))


def test_bad_slots_and_ranks_are_refused() -> None:
    slots = LoRASlots(SHAPE, max_loras=2, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds max_lora_rank 4"):
        slots.image(PeftAdapter(8, 16.0, ("q_proj",), None, {}))
    image = slots.image(PeftAdapter(1, 16.0, ("q_proj",), None, {}))
    with pytest.raises(ValueError, match=r"slot 2 is outside \[0, 2\)"):
        slots.load(2, image)
