"""The Triton path's fused element-wise kernels against a float64 reference (interpreted on the CPU, in
float32) and, on a GPU, against the torch ops they replace in bfloat16 (within one rounding step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from engine.model import fused_ops
from engine.model.layers.norm import rms_norm as _rms_norm
from engine.model.rope import RotaryEmbedding

EPS = 1e-5
# Triton needs CUDA tensors unless interpreted (TRITON_INTERPRET=1, as conftest sets on a CPU machine).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def rope_f64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [t, h, d]
    x, cos, sin = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 96), (33, 256)])
def test_rms_norm_with_and_without_residual(tokens, hidden):
    gen = torch.Generator().manual_seed(tokens)
    x, weight, residual = (
        t.to(DEVICE)
        for t in (
            torch.randn(tokens, hidden, generator=gen),
            torch.randn(hidden, generator=gen),
            torch.randn(tokens, hidden, generator=gen),
        )
    )
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, EPS), rms_norm_f64(x, weight).float())
    summed = residual.double() + x.double()
    kept = residual.clone()
    out = fused_ops.rms_norm(x, weight, EPS, residual=kept)
    torch.testing.assert_close(kept, summed.float())  # the residual now holds residual + x
    torch.testing.assert_close(out, rms_norm_f64(summed, weight).float())


def test_rms_norm_reads_strided_rows():
    """Input rows inside a wider buffer (a view), as a projection's output split would give."""
    wide = torch.randn(5, 160, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x, weight = wide[:, :64], torch.ones(64, device=DEVICE)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, EPS), rms_norm_f64(x, weight).float())


@pytest.mark.parametrize("tokens, width", [(1, 32), (9, 200), (4, 2048 + 17)])
def test_silu_and_mul(tokens, width):
    gate_up = torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(width)).to(DEVICE) * 4
    g, u = gate_up.double().chunk(2, dim=-1)
    expected = g * torch.sigmoid(g) * u
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 6, 32), (5, 1, 8)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(heads, kv_heads, head_dim):
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=10000.0)
    rope = RotaryEmbedding(config, head_dim, 64, torch.device(DEVICE), torch.float32)
    gen = torch.Generator().manual_seed(heads)
    tokens, q_size, kv_size = 11, heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    q, k, v = (t.clone() for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    cos, sin = rope.cos[positions], rope.sin[positions]
    fused_ops.apply_rope_(qkv, positions, rope.cos, rope.sin, heads, kv_heads, head_dim)
    out_q, out_k, out_v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    expected_q = rope_f64(q.view(tokens, heads, head_dim), cos, sin).reshape(tokens, -1)
    expected_k = rope_f64(k.view(tokens, kv_heads, head_dim), cos, sin).reshape(tokens, -1)
    torch.testing.assert_close(out_q, expected_q.float())
    torch.testing.assert_close(out_k, expected_k.float())
    assert torch.equal(out_v, v)


def test_fused_rope_takes_any_even_rotary_width():
    assert all(fused_ops.supports_fused_rope(d) for d in (128, 64, 96, 80, 12))
    assert not fused_ops.supports_fused_rope(7)


def no_worse_than_torch(fused: torch.Tensor, torch_ops: torch.Tensor, exact: torch.Tensor) -> None:
    """In bf16 the kernels round where torch rounds, but a sum may run in another order or a product be
    contracted into a sum: each may land one rounding step away, so compare errors against float64."""
    assert not torch.isnan(fused).any()
    fused_error = (fused.double() - exact).abs()
    torch_error = (torch_ops.double() - exact).abs()
    assert fused_error.max() <= 1.5 * torch_error.max() + 1e-6
    assert fused_error.mean() <= 1.5 * torch_error.mean() + 1e-9


@gpu
def test_bf16_is_as_accurate_as_the_torch_ops_they_replace_on_the_gpu():
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    tokens, heads, kv_heads, head_dim = 37, 32, 8, 64
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=500000.0)
    rope = RotaryEmbedding(config, head_dim, 2048, device, dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen, device=device).to(dtype)
    positions = torch.randint(0, 2048, (tokens,), generator=gen, device=device)
    q, k, _ = (t.clone() for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    cos, sin = rope.cos[positions], rope.sin[positions]
    torch_q, torch_k = rope(positions, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim))
    fused_ops.apply_rope_(qkv, positions, rope.cos, rope.sin, heads, kv_heads, head_dim)
    no_worse_than_torch(
        qkv[:, :q_size],
        torch_q.reshape(tokens, -1),
        rope_f64(q.view(tokens, heads, head_dim), cos, sin).reshape(tokens, -1),
    )
    no_worse_than_torch(
        qkv[:, q_size : q_size + kv_size],
        torch_k.reshape(tokens, -1),
        rope_f64(k.view(tokens, kv_heads, head_dim), cos, sin).reshape(tokens, -1),
    )

    hidden = 2048
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    torch_residual = residual + x
    torch_out = _rms_norm(torch_residual, weight, EPS)
    out = fused_ops.rms_norm(x, weight, EPS, residual=residual)
    assert torch.equal(residual, torch_residual)  # one rounded add, as torch's
    no_worse_than_torch(out, torch_out, rms_norm_f64(torch_residual, weight))

    gate_up = torch.randn(tokens, 2 * 8192, generator=gen, device=device).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    g, u = gate_up.double().chunk(2, dim=-1)
    no_worse_than_torch(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up, g * torch.sigmoid(g) * u)


# -- the newer families' kernels: GeGLU, Gemma's (1 + w) norm, q/k norms with RoPE, partial rotary --------


@pytest.mark.parametrize("tokens, width", [(1, 32), (5, 200)])
def test_gelu_tanh_and_mul(tokens, width):
    gate_up = torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(width)).to(DEVICE) * 3
    g, u = gate_up.double().chunk(2, dim=-1)
    expected = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * u
    out = fused_ops.act_and_mul(gate_up, "gelu_pytorch_tanh")
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-5)


def test_gemma_norm_scales_by_one_plus_the_weight():
    gen = torch.Generator().manual_seed(3)
    x, weight, residual = (torch.randn(*s, generator=gen).to(DEVICE) for s in ((6, 96), (96,), (6, 96)))
    expected = rms_norm_f64(residual.double() + x.double(), 1 + weight.double())
    kept = residual.clone()
    out = fused_ops.rms_norm(x, weight, EPS, residual=kept, offset=True)
    torch.testing.assert_close(out, expected.float())
    torch.testing.assert_close(out, _rms_norm(kept, weight, EPS, offset=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("offset", [False, True])
def test_head_norm_then_rope_in_place(offset):
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 9
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, rope_theta=10000.0)
    rope = RotaryEmbedding(config, head_dim, 64, torch.device(DEVICE), torch.float32)
    gen = torch.Generator().manual_seed(5)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    weights = torch.randn(2, head_dim, generator=gen).to(DEVICE)
    q, k, v = (t.clone() for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    fused_ops.head_norm_rope_(
        qkv, positions, rope.cos, rope.sin, weights, EPS, heads, kv_heads, head_dim, offset
    )
    cos, sin = rope.cos[positions], rope.sin[positions]
    scale = (1 + weights.double()) if offset else weights.double()
    for part, weight, n, start in ((q, scale[0], heads, 0), (k, scale[1], kv_heads, q_size)):
        normed = rms_norm_f64(part.view(tokens, n, head_dim), weight)
        expected = rope_f64(normed, cos, sin).reshape(tokens, -1)
        torch.testing.assert_close(qkv[:, start : start + n * head_dim], expected.float())
    assert torch.equal(qkv[:, q_size + kv_size :], v)


def test_partial_rotary_rope_leaves_the_tail_of_each_head():
    """Phi-4-mini's 0.75: 12 of 16 dims rotate (a half of 6, not a power of two), the last 4 pass."""
    heads, kv_heads, head_dim, tokens = 3, 1, 16, 7
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    )
    rope = RotaryEmbedding(config, head_dim, 32, torch.device(DEVICE), torch.float32)
    assert rope.rotary_dim == 12 and rope.cos.shape == (32, 12)
    gen = torch.Generator().manual_seed(6)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(DEVICE)
    positions = torch.randint(0, 32, (tokens,), generator=gen).to(DEVICE)
    q, k, _ = (t.clone() for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    torch_q, torch_k = rope(positions, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim))
    fused_ops.apply_rope_(qkv, positions, rope.cos, rope.sin, heads, kv_heads, head_dim)
    torch.testing.assert_close(qkv[:, :q_size], torch_q.reshape(tokens, -1))
    torch.testing.assert_close(qkv[:, q_size : q_size + kv_size], torch_k.reshape(tokens, -1))
    assert torch.equal(
        qkv[:, :q_size].view(tokens, heads, head_dim)[..., 12:], q.view(tokens, heads, 16)[..., 12:]
    )
