"""Read one rank's shard of a Llama-family checkpoint: each tensor sliced in the file, never read whole.

`safe_open(...).get_slice(name)[rows]` reads only the bytes of those rows (columns: the rows' bytes are
read, the other columns dropped before anything is converted or copied to the device), so a 70B
checkpoint split over 8 GPUs costs each rank an eighth of the host memory and the transfers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.fp8_checkpoint import fp8_scheme
from engine.model.kv_quant import default_scale
from engine.model.llama import LayerWeights, ModelWeights
from engine.model.loader import _weight_files
from engine.model.weight_source import open_checkpoint
from engine.parallel.plan import COLUMN_PARALLEL, ROW_PARALLEL, ShardPlan

_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def load_shard(
    path: Path,
    config,
    plan: ShardPlan,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    load_format: str = "auto",
) -> ModelWeights:
    """This rank's weights: q/k/v and gate/up fused by output, o and down by input, the vocabulary split."""
    if fp8_scheme(config, quantization) is not None:
        raise ValueError("FP8 weights are not supported with tensor_parallel_size > 1 yet")
    raw: dict[str, torch.Tensor] = {}
    for f in open_checkpoint(lambda: _weight_files(path), config, load_format, device, dtype):
        for name in f.keys():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raw[name] = _read_shard(f.get_slice(name), name, plan, rank).to(device=device, dtype=dtype)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"checkpoint {path} lacks tensor {name!r}; is it a Llama-family model?")
        return raw.pop(name)

    def take_optional(name: str) -> torch.Tensor | None:
        return raw.pop(name) if name in raw else None

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        biases = [take_optional(f"{p}self_attn.{m}_proj.bias") for m in "qkv"]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError(f"layer {i}: q/k/v biases must be all present or all absent")
        layers.append(
            LayerWeights(
                input_norm=take(f"{p}input_layernorm.weight"),
                qkv=torch.cat([take(f"{p}self_attn.{m}_proj.weight") for m in "qkv"]),
                qkv_bias=torch.cat(biases) if biases[0] is not None else None,
                o=take(f"{p}self_attn.o_proj.weight"),
                post_norm=take(f"{p}post_attention_layernorm.weight"),
                gate_up=torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")]),
                down=take(f"{p}mlp.down_proj.weight"),
                k_scale=default_scale(device),
                v_scale=default_scale(device),
            )
        )
    embed = take("model.embed_tokens.weight")
    norm = take("model.norm.weight")
    lm_head = take_optional("lm_head.weight")
    if lm_head is None or getattr(config, "tie_word_embeddings", False):
        lm_head = embed
    if raw:
        raise ValueError(f"checkpoint {path} has tensors this model does not use: {sorted(raw)[:5]}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


def _read_shard(tensor_slice, name: str, plan: ShardPlan, rank: int) -> torch.Tensor:
    """The rows or columns of `name` that `rank` holds (everything for norms)."""
    if name in _VOCAB_PARALLEL:
        start, end = plan.vocab_range(rank)
        rows = tensor_slice[start:end]
        missing = plan.vocab_per_rank - rows.shape[0]
        if missing:  # the last shard of a vocabulary the ranks do not divide: zero rows, never sampled
            rows = torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])
        return rows
    module = _projection(name)
    if module in COLUMN_PARALLEL:
        start, end = plan.output_range(module, rank)
        return tensor_slice[start:end]
    if module in ROW_PARALLEL:
        if name.endswith(".bias"):
            raise ValueError(f"{name}: a bias on a row-parallel projection is not supported")
        start, end = plan.input_range(module, rank)
        return tensor_slice[:, start:end]
    return tensor_slice[:]


def _projection(name: str) -> str | None:
    """'q_proj' for 'model.layers.3.self_attn.q_proj.weight' (or its bias); None for other tensors."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-2].endswith("_proj") else None
