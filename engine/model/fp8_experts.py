"""FP8 routed experts (block-scaled as Qwen3-30B-A3B-FP8, or compressed-tensors FP8 MoE checkpoints),
dequantized at load to the model dtype expert by expert: there is no FP8 fused-MoE kernel yet, so the
experts take the model dtype's memory; the attention, dense and shared-expert projections stay FP8.

A float8 expert weight comes with its scale beside it, "real = stored * scale" in every format:
    per expert  `mlp.experts.3.gate_proj.weight` [out, in] with `.weight_scale_inv` or `.weight_scale`
    fused       `mlp.experts.gate_up_proj` [E, out, in] with `gate_up_proj_scale_inv` (transformers 5)
One expert's scale is one number (per tensor), one per row ([out] or [out, 1]), or one per 128x128 block
([ceil(out/128), ceil(in/128)]). The fused gate_up may also keep gate's and up's blocks apart, as
transformers 5 does when it stacks per-expert checkpoints: [2 ceil(I/128), ceil(in/128)] (and per
tensor, one number per half: [2, 1]). A scale of any other shape is refused, naming the tensor.
"""

from __future__ import annotations

import torch

from engine.model.fp8_checkpoint import check_scales
from engine.model.fp8_linear import BLOCK
from engine.model.kv_quant import FP8_DTYPE

_SCALE_SUFFIXES = ("_scale_inv", "_scale")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_names(weight_name: str) -> tuple[str, ...]:
    """The names a float8 weight's scale may have: `X.weight_scale_inv`, `X.weight_scale`;
    fused `X.gate_up_proj_scale_inv`, `X.gate_up_proj_scale`."""
    return tuple(weight_name + s for s in _SCALE_SUFFIXES)


def scale_base(name: str) -> str | None:
    """The weight a scale tensor's name belongs to (None: not a scale's name)."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def expert_scale(
    name: str,  # the scale's checkpoint name, for errors
    scale_shape: tuple[int, ...],  # one expert's scale
    weight_shape: tuple[int, int],  # one expert's [out, in]
    halves: bool,  # a fused gate_up: gate's rows then up's, each half its own scale grid
) -> str:
    """Which layout one expert's scale has: "tensor", "halves_tensor", "channel", "blocks" or
    "halves_blocks"; ValueError naming the tensor for a shape that fits none (or two that differ)."""
    out_features, in_features = weight_shape
    size = 1
    for d in scale_shape:
        size *= d
    kb = -(-in_features // BLOCK)
    half = out_features // 2
    fits = []
    if size == 1:
        fits.append("tensor")
    if halves and tuple(scale_shape) in ((2,), (2, 1)):
        fits.append("halves_tensor")
    if tuple(scale_shape) in ((out_features,), (out_features, 1)):
        fits.append("channel")
    if tuple(scale_shape) == (-(-out_features // BLOCK), kb):
        fits.append("blocks")
    if halves and tuple(scale_shape) == (2 * -(-half // BLOCK), kb):
        if "blocks" not in fits:
            fits.append("halves_blocks")
        elif half % BLOCK:  # same shape, different blocks: which one the writer meant is unknowable
            raise ValueError(
                f"{name}: a scale of {list(scale_shape)} for gate_up's {out_features} rows is ambiguous: "
                "128-row blocks over the fused rows and over gate and up apart have that shape but differ"
            )
    if not fits:
        halves_hint = f", gate and up apart: [{2 * -(-half // BLOCK)}, {kb}]" if halves else ""
        raise ValueError(
            f"{name}: scale of shape {list(scale_shape)} fits no supported scheme for an expert weight of "
            f"{list(weight_shape)} (per tensor: 1, per channel: [{out_features}, 1], 128x128 blocks: "
            f"[{-(-out_features // BLOCK)}, {kb}]{halves_hint})"
        )
    return fits[0]


def dequantize_expert(
    name: str,
    weight: torch.Tensor,  # [out, in] float8_e4m3fn, one expert
    scale: torch.Tensor,  # that expert's scale, in `layout`
    layout: str,
    dtype: torch.dtype,
) -> torch.Tensor:  # [out, in] of `dtype`: e4m3 values times their scales in float32, rounded once
    out_features, in_features = weight.shape
    scale = scale.float()
    check_scales(name, scale)
    if layout == "tensor":
        full = scale.reshape(1, 1)
    elif layout == "channel":
        full = scale.reshape(out_features, 1)
    elif layout == "halves_tensor":
        full = scale.reshape(2, 1).repeat_interleave(out_features // 2, 0)
    elif layout == "blocks":
        full = _blocks(scale, out_features, in_features)
    else:  # halves_blocks
        rows = scale.shape[0] // 2
        half = out_features // 2
        full = torch.cat([_blocks(s, half, in_features) for s in (scale[:rows], scale[rows:])])
    return (weight.float() * full).to(dtype)


def _blocks(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:  # [nb, kb] -> [rows, cols]
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


class Fp8ExpertTensor:
    """A float8 expert weight (per-expert [out, in] or fused [E, out, in]) read as its dequantized value,
    lazily: `rows` of a fused tensor dequantizes only the experts asked for (a rank reads only its own),
    one at a time. The scale's shape is checked here, before anything is read."""

    is_float8 = False

    def __init__(self, weight, scale, dtype: torch.dtype, halves: bool, device: torch.device | None = None):
        self.name, self.shape = weight.name, tuple(weight.shape)
        self._weight, self._scale, self._dtype = weight, scale, dtype
        self._device = device or torch.device("cpu")  # where the multiply runs and the result lands
        self._fused = len(self.shape) == 3
        if len(self.shape) not in (2, 3):
            raise ValueError(f"checkpoint tensor {weight.name!r} of {list(self.shape)} is no expert weight")
        scale_shape = tuple(scale.shape)
        if self._fused:
            experts = self.shape[0]
            if scale_shape in ((experts,), (experts, 1)):
                scale_shape = (experts, 1, 1)  # one number per expert
            if len(scale_shape) not in (2, 3) or scale_shape[0] != experts:
                raise ValueError(
                    f"{scale.name}: scale of shape {list(scale.shape)} does not hold one scale per expert of "
                    f"{weight.name!r} {list(self.shape)} (expected [{experts}, ...])"
                )
            self._scale_shape = scale_shape
            scale_shape = scale_shape[1:]
        self._layout = expert_scale(scale.name, scale_shape, self.shape[-2:], halves)

    def _expert(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{self.name}: only float8 e4m3 weights are served (got {weight.dtype})")
        if scale.dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"{self._scale.name}: scales must be float32, bfloat16 or float16 ({scale.dtype})"
            )
        weight, scale = weight.to(self._device), scale.to(self._device)
        return dequantize_expert(self._scale.name, weight, scale, self._layout, self._dtype)

    def rows(self, start: int, end: int) -> torch.Tensor:
        if not self._fused:
            return self.read()[start:end]
        out = torch.empty((end - start, *self.shape[1:]), dtype=self._dtype, device=self._device)
        for e in range(start, end):
            scale = self._scale.rows(e, e + 1).reshape(self._scale_shape[1:])
            out[e - start] = self._expert(self._weight.rows(e, e + 1)[0], scale)
        return out

    def cols(self, start: int, end: int) -> torch.Tensor:
        return self.read()[:, start:end]

    def read(self) -> torch.Tensor:
        if self._fused:
            return self.rows(0, self.shape[0])
        return self._expert(self._weight.read(), self._scale.read())


def dequantize_experts(tensors: list, dtype_of, device: torch.device | None = None) -> list:
    """The checkpoint's tensors with every float8 expert weight and its scale replaced by one
    Fp8ExpertTensor of `dtype_of(name)` (None: not an expert's or router's weight, left alone); a missing
    scale, or a scale beside an expert weight that is not float8, is refused naming the tensor. The
    multiply runs on `device` (the model's: a GPU dequantizes a 235B checkpoint's experts quickly)."""
    by_name = {t.name: t for t in tensors}
    consumed, replaced = set(), {}
    for tensor in tensors:
        base = scale_base(tensor.name)
        if base is not None and base in by_name and dtype_of(base) is not None:
            if not by_name[base].is_float8:
                raise ValueError(
                    f"checkpoint tensor {tensor.name!r} is a weight scale but {base!r} is not float8"
                )
            continue
        dtype = dtype_of(tensor.name) if tensor.is_float8 else None
        if dtype is None:
            continue
        names = [n for n in scale_names(tensor.name) if n in by_name]
        if not names:
            raise ValueError(
                f"checkpoint tensor {tensor.name!r} is float8 but has no scale beside it "
                f"(expected {' or '.join(repr(n) for n in scale_names(tensor.name))})"
            )
        if len(names) > 1:
            raise ValueError(f"checkpoint tensor {tensor.name!r} has two scales: {names}")
        scale = by_name[names[0]]
        halves = tensor.name.endswith("gate_up_proj")
        replaced[tensor.name] = Fp8ExpertTensor(tensor, scale, dtype, halves, device)
        consumed.add(scale.name)
    return [replaced.get(t.name, t) for t in tensors if t.name not in consumed]
