"""DoRA's norms, one projection at a time: ||W + s B A||^2 per output row against float64, formed a chunk
of rows at a time, over float and FP8 (per-channel and 128-column block) base weights; the base weight is
never written."""

from __future__ import annotations

import pytest
import torch

from engine.lora import dora
from engine.model.fp8_linear import Fp8Linear, dequantize, quantize_weight


def test_squared_norms_match_float64_in_chunks(monkeypatch):
    monkeypatch.setattr(dora, "ROWS_PER_CHUNK", 7)  # 3 chunks over 20 rows, the last one short
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(30, 48, generator=gen)
    before = weight.clone()
    a, b = torch.randn(4, 48, generator=gen), torch.randn(20, 4, generator=gen)
    squares = dora.squared_norms(weight, (10, 30), a, b, 0.75)
    want = (weight[10:30].double() + 0.75 * b.double() @ a.double()).square().sum(1)
    torch.testing.assert_close(squares.double(), want, rtol=1e-6, atol=0)
    assert torch.equal(weight, before), "the base weight must never be written"


@pytest.mark.parametrize("group_size", [None, 128], ids=["per_channel", "block"])
def test_fp8_weights_are_dequantized_as_the_model_multiplies_by_them(group_size):
    gen = torch.Generator().manual_seed(1)
    weight, scale = quantize_weight(torch.randn(40, 200, generator=gen), group_size)
    kernel = Fp8Linear(weight, scale, group_size or 200)
    rows = dora.dense_rows(kernel, 5, 25)
    assert torch.equal(rows, dequantize(kernel, torch.float32)[5:25])
    a, b = torch.randn(2, 200, generator=gen), torch.randn(20, 2, generator=gen)
    want = (dequantize(kernel, torch.float64)[5:25] + 2.0 * b.double() @ a.double()).square().sum(1)
    torch.testing.assert_close(
        dora.squared_norms(kernel, (5, 25), a, b, 2.0).double(), want, rtol=1e-6, atol=0
    )
