"""A checkpoint tensor read lazily, so each rank reads only the rows or columns its shard holds."""

from __future__ import annotations

import torch

# safetensors' names of the float8 formats; only e4m3 is served (engine/model/fp8_checkpoint.py).
FLOAT8_NAMES = ("F8_E4M3", "F8_E5M2")


class CheckpointTensor:
    """One tensor of an open safetensors file (`safe_open`); nothing is read until asked for."""

    def __init__(self, handle, name: str):
        self.name = name
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.is_float8 = self._slice.get_dtype() in FLOAT8_NAMES

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self._slice[start:end]

    def cols(self, start: int, end: int) -> torch.Tensor:
        return self._slice[:, start:end]

    def read(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)


class InMemoryTensor:
    """The same reads of a tensor already in memory (random weights, tests)."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self._tensor = name, tensor
        self.shape = tuple(tensor.shape)
        self.is_float8 = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self._tensor[start:end]

    def cols(self, start: int, end: int) -> torch.Tensor:
        return self._tensor[:, start:end]

    def read(self) -> torch.Tensor:
        return self._tensor
