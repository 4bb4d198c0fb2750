"""Workload W1's model and adapters (random weights written as a checkpoint and PEFT folders), and
the byte counts and copy bandwidth behind the decode-step floor. Used by throughput.py."""

from __future__ import annotations

import gc
import random
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {
    "S": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "L": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    # Llama-3.1-70B's shape (benchmarks/tensor_parallel.py; its weights are made per rank on the GPUs with
    # load_format="dummy", never written).
    "70B": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "smoke": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}


# -- model and adapters ----------------------------------------------------------------------------


def llama_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5)


def random_prompts(
    rng: random.Random, vocab_size: int, num: int, min_len: int, max_len: int
) -> list[list[int]]:
    """W1's prompts: `num` of random token ids (3 and up: clear of special ids), lengths uniform in
    [min_len, max_len], drawn from `rng`."""
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


class Prompts(NamedTuple):
    """The measured run's prompts and the unmeasured warm-up run's: different prompts of the same sizes'
    distribution, so the measured run finds nothing of its own in the prefix cache (a warm-up on the same
    prompts would leave every measured prefill a cache hit)."""

    measured: list[list[int]]
    warm_up: list[list[int]]


def prompt_sets(rng: random.Random, vocab_size: int, num: int, min_len: int, max_len: int) -> Prompts:
    measured = random_prompts(rng, vocab_size, num, min_len, max_len)  # drawn first: the same as before
    return Prompts(measured, random_prompts(rng, vocab_size, num, min_len, max_len))


def write_config(path: Path, shape: str, dtype: torch.dtype) -> Path:
    """config.json alone: enough for an engine with load_format="dummy" (random weights made on the device)."""
    config = llama_config(shape)
    config.dtype = dtype
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    return path


def make_model(path: Path, shape: str, dtype: torch.dtype, device: torch.device) -> Path:
    """Random weights (std 0.02, norms 1) written straight to safetensors; no 1B-parameter init on the CPU."""
    config = llama_config(shape)
    config.dtype = dtype
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    tensors = {
        "model.embed_tokens.weight": rand(config.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=dtype),
    }
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, size in (
            ("self_attn.q_proj", (h, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ):
            tensors[f"{p}{name}.weight"] = rand(*size)
        tensors[f"{p}input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[f"{p}post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def module_dims(config) -> dict[str, tuple[int, int]]:
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    return {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def make_adapters(
    root: Path,
    model_dir: Path,
    config,
    count: int,
    rank: int,
    dtype: torch.dtype,
    distinct: int | None = None,
) -> list[Path]:
    """PEFT folders (adapter_config.json + adapter_model.safetensors), rank `rank` over all 7 projections.
    With `distinct`, only that many are written and the list repeats them (an engine registers each
    entry under a name of its own, so it still holds `count` adapters: less to write for large shapes)."""
    from peft import LoraConfig

    if distinct is not None and distinct < count:
        made = make_adapters(root, model_dir, config, distinct, rank, dtype)
        return [made[i % distinct] for i in range(count)]
    paths = []
    for a in range(count):
        gen = torch.Generator().manual_seed(100 + a)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in module_dims(config).items():
                block = "self_attn" if module in MODULES[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).to(dtype)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(dtype)
        path = root / f"adapter{a}"
        LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=list(MODULES),
            task_type="CAUSAL_LM",
            base_model_name_or_path=str(model_dir),
        ).save_pretrained(str(path))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        paths.append(path)
    return paths


# -- bytes and bandwidth ---------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times[2:])


# Split by output under tensor parallelism (their LoRA B too); the others, o and down, by input (their A).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def rank_dims(config, tp: int = 1) -> dict[str, tuple[int, int]]:
    """module_dims of one rank's shard (tp 1: the whole model). KV heads fewer than the ranks are
    replicated, one per rank (engine/parallel/plan.py)."""
    head_dim = config.hidden_size // config.num_attention_heads
    kv_rows = max(1, config.num_key_value_heads // tp) * head_dim
    dims = {}
    for module, (fan_in, fan_out) in module_dims(config).items():
        if module in ("k_proj", "v_proj"):
            dims[module] = (fan_in, kv_rows)
        elif module in COLUMN_PARALLEL:
            dims[module] = (fan_in, fan_out // tp)
        else:
            dims[module] = (fan_in // tp, fan_out)
    return dims


def base_weight_bytes(config, element: int, fp8: bool = False, tp: int = 1) -> int:
    """Bytes a decode step reads from the base weights on one GPU (its shard, with `tp` ranks): every
    layer, the final norm, the LM head (vocabulary-parallel). With `fp8` the seven projections take one
    byte a weight plus a float32 scale per output row."""
    dims = rank_dims(config, tp).values()
    projections = sum(fan_in * fan_out for fan_in, fan_out in dims)
    projection_bytes = projections + 4 * sum(fan_out for _, fan_out in dims) if fp8 else element * projections
    other = element * (
        config.num_hidden_layers * 2 * config.hidden_size
        + -(-config.vocab_size // tp) * config.hidden_size
        + config.hidden_size
    )
    return config.num_hidden_layers * projection_bytes + other


def kv_bytes_per_token(config, element: int, tp: int = 1) -> int:
    """K and V of one token over all layers on one GPU (its KV heads)."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * max(1, config.num_key_value_heads // tp) * head_dim * element


def adapter_bytes(config, rank: int, element: int, tp: int = 1) -> int:
    """One adapter's A and B on one GPU: a column-parallel projection's A is whole and its B split, a
    row-parallel one's A split and its B whole (engine/parallel/lora_shards.py)."""
    return element * config.num_hidden_layers * sum(rank * (i + o) for i, o in rank_dims(config, tp).values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
