"""MXFP4 checkpoints (gpt-oss on the hub: config.json `quantization_config.quant_method == "mxfp4"`):
the experts' weights are stored as 4-bit floats (e2m1) in blocks of 32 sharing one power-of-two scale,
and are dequantized at load to the model dtype, as transformers does without its kernels.

    `..._blocks` [*lead, G, 16] uint8: 32 values per block, two per byte (low nibble first)
    `..._scales` [*lead, G]     uint8: each block's exponent, biased by 127
    value = E2M1[nibble] * 2 ** (scale - 127)  ->  [*lead, G * 32]

For gpt-oss `*lead` is [E, out rows]: the dequantized tensor is the projection's [E, out, in] weight.
"""

from __future__ import annotations

import torch

# The 16 e2m1 values by their 4-bit code: sign bit, then 2 exponent bits and 1 mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per shared scale


def pair_up(blocks_shape, scales_shape) -> bool:
    """Whether blocks [*lead, G, 16] and scales [*lead, G] are one weight's."""
    return blocks_shape[-1] == BLOCK // 2 and tuple(blocks_shape[:-1]) == tuple(scales_shape)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[*lead, G, 16] uint8 codes and [*lead, G] uint8 biased exponents -> [*lead, G * 32] of `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8 (got {blocks.dtype} and {scales.dtype})")
    if not pair_up(blocks.shape, scales.shape):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair up "
            f"(blocks [..., G, {BLOCK // 2}], scales [..., G])"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)


class Mxfp4Tensor:
    """A checkpoint tensor read as its dequantized value, from its `_blocks` and `_scales` tensors
    (CheckpointTensor), lazily and by leading rows (a rank reads only its experts)."""

    is_float8 = False

    def __init__(self, name: str, blocks, scales, dtype: torch.dtype):
        self.name, self._blocks, self._scales, self._dtype = name, blocks, scales, dtype
        if not pair_up(blocks.shape, scales.shape):
            raise ValueError(
                f"checkpoint tensors {blocks.name!r} {list(blocks.shape)} and {scales.name!r} "
                f"{list(scales.shape)} are not MXFP4 blocks and scales of one weight"
            )
        self.shape = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Leading rows [start, end) dequantized, one at a time (an expert of gpt-oss-120b's gate_up is
        16.6 M values: its float32 intermediates stay small)."""
        out = torch.empty((end - start, *self.shape[1:]), dtype=self._dtype)
        for row in range(start, end):
            blocks, scales = self._blocks.rows(row, row + 1), self._scales.rows(row, row + 1)
            out[row - start] = dequantize_mxfp4(blocks, scales, self._dtype)[0]
        return out

    def read(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])
