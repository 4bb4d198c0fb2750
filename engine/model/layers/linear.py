"""Projections split over the tensor-parallel ranks, each loading its own shard of the checkpoint.

- `ColumnParallelLinear` splits the output: each rank computes its own rows of every *part* (q, k, v of
  a fused qkv_proj; gate and up of gate_up_proj), with no communication.
- `RowParallelLinear` splits the input: each rank's output is a partial sum, made whole by one
  all-reduce (o_proj, down_proj).

Every parameter carries its own `weight_loader(param, tensor, shard)`: `shard` is the part a checkpoint
tensor fills (q_proj -> part 0 of qkv_proj, through the model's `packed_modules_mapping`) or None for a
tensor that holds every part (Phi-3's own qkv_proj). The loader reads only this rank's rows or columns.

With FP8 (`BuildContext.fp8`) the weight is float8 e4m3 with one float32 scale per row and group of input
columns (engine/model/fp8_linear.py): float8 checkpoint tensors are copied with their scales, float ones
quantized on arrival. LoRA is added on top of either, in the model dtype, one launch per projection
(`LoRAContext.apply` with the projection's LoRA targets, e.g. q_proj, k_proj, v_proj in column order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.model.fp8_checkpoint import grouped_scale, resolve_gemm
from engine.model.fp8_linear import BLOCK, Fp8Linear, linear, quantize_with, weight_scales
from engine.model.kv_quant import FP8_DTYPE
from engine.model.layers.context import BuildContext
from engine.model.layers.sharding import PartialSums, Split


def new_param(
    shape, dtype: torch.dtype, device: torch.device, loader, parts: Sequence = (None,)
) -> nn.Parameter:
    """An uninitialised parameter with its loader and the shards it needs before the model may run."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    param.required = set(parts)
    param.loaded = set()
    return param


def check_shape(tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor {tensor.name!r} has shape {list(tensor.shape)}, but this model needs "
            f"{list(expected)} (config.json and the weights disagree)"
        )


def refuse_float8(tensor) -> None:
    raise ValueError(
        f"checkpoint stores {tensor.name!r} as float8 but config.json's quantization_config does not "
        "describe it (only the linear projections of a supported FP8 format are read)"
    )


class ParallelLinear(nn.Module):
    """The parameters, FP8 handling and `kernel` (what forward multiplies by) of both kinds."""

    def __init__(self, out_features: int, in_features: int, ctx: BuildContext, bias_size: int | None, parts):
        super().__init__()
        self.ctx = ctx
        self.tp = ctx.tp
        self.layer: int | None = None  # set by the model: the LoRA pool's layer index
        self.lora_modules: tuple[str, ...] = ()  # set by the model: LoRA targets in column order
        self.name = ""  # set by the model: the module path, for messages
        self.kernel: torch.Tensor | Fp8Linear | None = None  # set by finish_loading
        fp8 = ctx.fp8
        if fp8 is None:
            self.weight = new_param(
                (out_features, in_features), ctx.dtype, ctx.device, self._load_weight, parts
            )
        else:
            self.group_size = BLOCK if fp8.blocked and in_features > BLOCK else in_features
            groups = -(-in_features // self.group_size)
            self.weight = new_param(
                (out_features, in_features), FP8_DTYPE, ctx.device, self._load_weight, parts
            )
            self.weight_scale = new_param(
                (out_features, groups), torch.float32, ctx.device, self._load_scale, parts
            )
            self.weight_scale.loaded_from_file = set()
            self._float_parts: set = set()  # parts quantized here: their scales must not come from the file
        self.bias = None
        if bias_size is not None:
            self.bias = new_param((bias_size,), ctx.dtype, ctx.device, self._load_bias, parts)

    def lora_delta(self, y: torch.Tensor, x: torch.Tensor, lora) -> None:
        if lora is not None and self.layer is not None and self.lora_modules:
            lora.apply(y, x, self.layer, self.lora_modules)

    def with_lora(self, x: torch.Tensor, lora) -> torch.Tensor:
        """x W^T + LoRA's update + bias: the bias after the update, which DoRA's scales must not touch."""
        if lora is None or self.bias is None or not self.lora_modules:
            y = linear(x, self.kernel, self.bias)
            self.lora_delta(y, x, lora)
            return y
        y = linear(x, self.kernel)
        self.lora_delta(y, x, lora)
        return y.add_(self.bias)

    def _put_weight(self, rows: slice, values: torch.Tensor, tensor, part, quantize_scale=None) -> None:
        """`values` into the weight's `rows`: copied, or quantized with its own scales (FP8 layers)."""
        if self.ctx.fp8 is None:
            if tensor.is_float8:
                refuse_float8(tensor)
            self.weight.data[rows].copy_(values)
            return
        if tensor.is_float8:
            if values.dtype != FP8_DTYPE:
                raise ValueError(f"{tensor.name}: only float8 e4m3 weights are served")
            self.weight.data[rows].copy_(values)
            return
        values = values.to(self.ctx.device)
        scale = weight_scales(values, self.group_size)
        if quantize_scale is not None:
            scale = quantize_scale(scale)
        self.weight.data[rows].copy_(quantize_with(values, scale, self.group_size))
        self.weight_scale.data[rows].copy_(scale)
        self.weight_scale.loaded.add(part)
        self._float_parts.add(part)

    def fill_dummy(self, gen: torch.Generator) -> None:
        """Random weights (std 0.02) for load_format="dummy", quantized if this projection is FP8."""
        shape = self.weight.shape
        for part in sorted(self.weight.required, key=lambda p: -1 if p is None else p):
            rows = slice(None) if part is None else self._part_rows(part)
            num_rows = len(range(*rows.indices(shape[0])))
            values = torch.empty(num_rows, shape[1], device=self.ctx.device, dtype=self.ctx.dtype)
            values.normal_(0.0, 0.02, generator=gen)
            source = _Drawn()
            self._put_weight(rows, values, source, part)
            self.weight.loaded.add(part)
            if self.ctx.fp8 is not None:
                self.weight_scale.loaded.add(part)
        if self.bias is not None:
            self.bias.data.zero_()
            self.bias.loaded |= self.bias.required

    def _part_rows(self, part: int) -> slice:
        return slice(None)

    def finish_loading(self) -> None:
        """Check what the checkpoint gave and build the kernel (an Fp8Linear resolves its GEMM here)."""
        if self.ctx.fp8 is None:
            self.kernel = self.weight.data
            return
        mixed = self._float_parts & self.weight_scale.loaded_from_file
        if mixed:
            raise ValueError(f"{self.name}: the checkpoint has a scale for a weight that is not float8")
        kernel = Fp8Linear(self.weight.data, self.weight_scale.data, self.group_size)
        gemm = resolve_gemm(self.name, kernel, self.ctx.device, self.ctx.fp8.gemm)
        self.kernel = Fp8Linear(kernel.weight, kernel.scale, self.group_size, gemm)

    def _load_weight(self, param, tensor, shard) -> None:
        raise NotImplementedError

    def _load_scale(self, param, tensor, shard) -> None:
        raise NotImplementedError

    def _load_bias(self, param, tensor, shard) -> None:
        raise NotImplementedError


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T (+ b), W's rows split by part over the ranks: [sum of local parts, in]."""

    def __init__(self, in_features: int, parts: Sequence[Split], ctx: BuildContext, bias: bool = False):
        world = ctx.tp.world_size
        self.in_features = in_features
        self.parts = list(parts)
        local = [p.local_size(world) for p in self.parts]
        self.local_offsets = [sum(local[:i]) for i in range(len(local))]
        self.out_local = sum(local)
        shards = range(len(self.parts))
        super().__init__(self.out_local, in_features, ctx, self.out_local if bias else None, shards)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # [tokens, in] -> [tokens, out_local]
        return self.with_lora(x, lora)

    def _pieces(self, tensor, shard, columns: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """(part, first row of the part in `tensor`, this rank's [start, end) within the part) per part
        the tensor fills, after checking its shape ([rows, *columns])."""
        parts = range(len(self.parts)) if shard is None else [shard]
        pieces, offset = [], 0
        for p in parts:
            start, end = self.parts[p].range(self.tp.rank, self.tp.world_size)
            pieces.append((p, offset, start, end))
            offset += self.parts[p].size
        check_shape(tensor, (offset, *columns))
        return pieces

    def _part_rows(self, part: int) -> slice:
        start, end = self.parts[part].range(self.tp.rank, self.tp.world_size)
        return self._local_rows(part, start, end)

    def _local_rows(self, part: int, start: int, end: int) -> slice:
        first = self.local_offsets[part]
        return slice(first, first + end - start)

    def _load_weight(self, param, tensor, shard) -> None:
        for part, offset, start, end in self._pieces(tensor, shard, (self.in_features,)):
            values = tensor.rows(offset + start, offset + end)
            self._put_weight(self._local_rows(part, start, end), values, tensor, part)
            param.loaded.add(part)

    def _load_bias(self, param, tensor, shard) -> None:
        for part, offset, start, end in self._pieces(tensor, shard, ()):
            if tensor.is_float8:
                refuse_float8(tensor)
            param.data[self._local_rows(part, start, end)].copy_(tensor.rows(offset + start, offset + end))
            param.loaded.add(part)

    def _load_scale(self, param, tensor, shard) -> None:
        parts = range(len(self.parts)) if shard is None else [shard]
        total = sum(self.parts[p].size for p in parts)
        full = grouped_scale(tensor.name, (total, self.in_features), tensor.read(), self.group_size)
        offset = 0
        for p in parts:
            start, end = self.parts[p].range(self.tp.rank, self.tp.world_size)
            param.data[self._local_rows(p, start, end)].copy_(full[offset + start : offset + end])
            param.loaded.add(p)
            param.loaded_from_file.add(p)
            offset += self.parts[p].size


class RowParallelLinear(ParallelLinear):
    """y = sum over ranks of x_r W_r^T (+ b), W's columns split over the ranks: [out, in_local]."""

    def __init__(self, inputs: Split, out_features: int, ctx: BuildContext, bias: bool = False):
        tp = ctx.tp
        self.inputs, self.out_features = inputs, out_features
        self.in_start, self.in_end = inputs.range(tp.rank, tp.world_size)
        if ctx.fp8 is not None and ctx.fp8.blocked and tp.world_size > 1 and self.in_start % BLOCK:
            raise ValueError(block_cut_message("a row-parallel projection", inputs.size, tp.world_size))
        in_local = self.in_end - self.in_start
        super().__init__(out_features, in_local, ctx, out_features if bias else None, (None,))
        # Set by the model where an RMSNorm with the residual add comes next: forward returns PartialSums
        # and that norm all-reduces them (fused, engine/parallel/fused_allreduce.py).
        self.defer_reduce = False
        if ctx.fp8 is not None:  # the checkpoint's groups: 128 columns of the whole input, or all of it
            self.file_group_size = BLOCK if ctx.fp8.blocked and inputs.size > BLOCK else inputs.size

    def forward(
        self, x: torch.Tensor, lora=None
    ) -> torch.Tensor | PartialSums:  # [tokens, in_local] -> [tokens, out]
        if self.tp.world_size == 1:
            return self.with_lora(x, lora)
        # Partial sums, LoRA's too (its A holds this rank's input columns): one all-reduce completes both.
        y = linear(x, self.kernel)
        self.lora_delta(y, x, lora)
        if self.defer_reduce:
            return PartialSums(y, self.bias, self.tp)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def _load_weight(self, param, tensor, shard) -> None:
        check_shape(tensor, (self.out_features, self.inputs.size))
        values = tensor.cols(self.in_start, self.in_end)
        self._put_weight(slice(None), values, tensor, None, self._scale_over_ranks)
        param.loaded.add(None)

    def _scale_over_ranks(self, scale: torch.Tensor) -> torch.Tensor:
        """Per-row scales quantized here are the maximum over every rank's columns: one GPU's scales."""
        if self.group_size == self.in_end - self.in_start and self.tp.world_size > 1:
            return self.tp.all_max_(scale)
        return scale  # groups of 128 columns lie within one rank's shard

    def _load_bias(self, param, tensor, shard) -> None:
        check_shape(tensor, (self.out_features,))
        if tensor.is_float8:
            refuse_float8(tensor)
        param.data.copy_(tensor.rows(0, self.out_features))
        param.loaded.add(None)

    def _load_scale(self, param, tensor, shard) -> None:
        shape = (self.out_features, self.inputs.size)
        full = grouped_scale(tensor.name, shape, tensor.read(), self.file_group_size)
        if full.shape[1] > 1:  # groups of 128 columns: this rank's (its shard starts on a group)
            full = full[:, self.in_start // BLOCK : -(-self.in_end // BLOCK)]
        param.data.copy_(full)
        param.loaded.add(None)
        param.loaded_from_file.add(None)


class _Drawn:
    """The stand-in checkpoint tensor of a random draw (load_format="dummy")."""

    name = "random weights"
    is_float8 = False


def block_cut_message(projection: str, in_features: int, world_size: int) -> str:
    return (
        f"tensor_parallel_size {world_size} cuts {projection}'s {in_features} input columns "
        f"into shards of {in_features // world_size}, inside the checkpoint's {BLOCK}x{BLOCK} scale blocks; "
        f"block-scaled FP8 needs shards of whole blocks (a multiple of {BLOCK} columns): choose another "
        "tensor_parallel_size, or quantization='fp8' on the bf16 checkpoint"
    )
