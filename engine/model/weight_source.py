"""Where the loaders read tensors from: the checkpoint's safetensors files, or (vLLM's
`load_format="dummy"`) random tensors of the checkpoint's names and shapes, made on the device.

Both sources look like `safetensors.safe_open` handles (`keys()`, `get_tensor(name)`,
`get_slice(name)[rows]`), so the single-GPU loader and the tensor-parallel shard loader read either
without knowing which. A dummy slice is made at the size of the slice, on the device, in the model
dtype: a rank of a 70B model split over four GPUs builds its 35 GB shard in seconds, and nothing of the
whole model ever exists on the host. Only `config.json` (and a tokenizer, unless skipped) must exist.

Dummy values: projections and embeddings normal with std 0.02, norms 1, biases 0 (the random-weight
benchmarks' model); each tensor's values follow from its name and slice, so a run is reproducible for
a given tensor_parallel_size, but ranks of different sizes hold different models.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

# vLLM's --load-format values we serve: "auto" and "safetensors" read the checkpoint (safetensors
# only), "dummy" makes random weights.
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_STD = 0.02


def open_checkpoint(
    files: Callable[[], list[Path]], config, load_format: str, device: torch.device, dtype: torch.dtype
) -> Iterator:
    """safe_open-like handles: one per file of `files()` (called only when reading files), or one
    DummyCheckpoint for "dummy"."""
    if load_format == "dummy":
        return iter([DummyCheckpoint(config, device, dtype)])
    return _file_handles(files())


def _file_handles(files: list[Path]) -> Iterator:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f


class DummyCheckpoint:
    """The tensors a Llama-family checkpoint of `config` holds, made on demand (see the module docstring)."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.shapes = checkpoint_shapes(config)

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]

    def get_slice(self, name: str) -> _DummySlice:
        return _DummySlice(self, name)

    def make(self, name: str, index) -> torch.Tensor:
        shape = torch.empty(self.shapes[name], device="meta")[index].shape  # the slice's shape, no data
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        seed = zlib.crc32(f"{name}{index}".encode())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        return values.normal_(0.0, DUMMY_STD, generator=generator)


class _DummySlice:
    def __init__(self, checkpoint: DummyCheckpoint, name: str):
        self.checkpoint, self.name = checkpoint, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.checkpoint.make(self.name, index)

    def get_shape(self) -> list[int]:
        return list(self.checkpoint.shapes[self.name])


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Llama-family (Llama, Mistral, Qwen2) checkpoint of `config`."""
    h, i = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    biases = getattr(config, "model_type", None) == "qwen2" or getattr(config, "attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, h)
            if biases:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, q)
        shapes[f"{p}mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, i)
    return shapes
