"""Workload W1's model and adapters (random weights written as a checkpoint and PEFT folders), and
the byte counts and copy bandwidth behind the decode-step floor. Used by throughput.py.

Shapes: S and L are Llama (3.2-1B, 3.1-8B); `qwen3-8b` and `gemma3-12b` are those models' shapes in their
own architectures (Qwen3's q/k norms; Gemma 3's 5:1 local/global layers over a 1024-token window,
head_dim 256, a 262k vocabulary, tied embeddings). Byte counts come from the engine's own model of the
shape, built on the meta device, so every architecture's floor counts what its step reads."""

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


# Other architectures: (model_type of the config class, its sizes).
FAMILY_SHAPES = {
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "gemma3-12b": (
        "gemma3_text",
        dict(
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=262208,
            tie_word_embeddings=True,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        ),
    ),
    # CPU smoke runs of the two (tiny sizes, the same architectures)
    "qwen3-smoke": (
        "qwen3",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
        ),
    ),
    "gemma3-smoke": (
        "gemma3_text",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}
ALL_SHAPES = [*SHAPES, *FAMILY_SHAPES]


# -- model and adapters ----------------------------------------------------------------------------


def llama_config(shape: str):
    """The shape's config: Llama for S, L and smoke, the shape's own architecture otherwise."""
    if shape in FAMILY_SHAPES:
        from transformers import AutoConfig

        model_type, sizes = FAMILY_SHAPES[shape]
        config = AutoConfig.for_model(model_type, max_position_embeddings=2048, **sizes)
        config.architectures = [{"qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[model_type]]
        return config
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


def make_model(
    path: Path, shape: str, dtype: torch.dtype, device: torch.device, weights: bool = True
) -> Path:
    """Random weights (std 0.02, norms 1) written straight to safetensors; no 1B-parameter init on the CPU.
    `weights=False`: config.json only, for the engine's load_format="dummy" (random weights on the device)."""
    config = llama_config(shape)
    config.dtype = dtype
    if shape in FAMILY_SHAPES or not weights:
        return _make_family_model(path, config, dtype, device, weights)
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


def _make_family_model(path: Path, config, dtype: torch.dtype, device: torch.device, weights: bool) -> Path:
    """Any architecture: the checkpoint's names and shapes from transformers' model on the meta device,
    each tensor drawn on `device` (norms at their identity: 1, or 0 for Gemma's 1 + w)."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    if not weights:
        return path
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator(device=device).manual_seed(0)
    offset = config.model_type.startswith("gemma")
    tensors = {}
    for name, t in meta.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if t.dim() == 1 and "norm" in name:
            tensors[name] = torch.full(t.shape, 0.0 if offset else 1.0, dtype=dtype)
        else:
            drawn = torch.randn(*t.shape, generator=gen, device=device, dtype=torch.float32) * 0.02
            tensors[name] = drawn.to(dtype).cpu()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def model_shape(config):
    from engine.model.registry import model_shape as shape_of

    return shape_of(config)


def module_dims(config) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection LoRA may target: the seven for Llama, Qwen3 and Gemma."""
    shape = model_shape(config)
    return {m: shape.module_dims(m) for m in shape.targets}


def make_adapters(
    root: Path,
    model_dir: Path,
    config,
    count: int,
    rank: int,
    dtype: torch.dtype,
    distinct: int | None = None,
) -> list[Path]:
    """PEFT folders (adapter_config.json + adapter_model.safetensors), rank `rank` over every projection.
    With `distinct`, only that many are written and the list repeats them (an engine registers each
    entry under a name of its own, so it still holds `count` adapters: less to write for large shapes)."""
    from peft import LoraConfig

    if distinct is not None and distinct < count:
        made = make_adapters(root, model_dir, config, distinct, rank, dtype)
        return [made[i % distinct] for i in range(count)]
    shape = model_shape(config)
    paths = []
    for a in range(count):
        gen = torch.Generator().manual_seed(100 + a)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in module_dims(config).items():
                block = shape.block(module)
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).to(dtype)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(dtype)
        path = root / f"adapter{a}"
        LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=list(shape.targets),
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


def shard_plan(config, tp: int):
    """How the engine splits the shape over `tp` ranks (engine/parallel/plan.py)."""
    from engine.parallel.plan import ShardPlan

    return ShardPlan.for_model(config, tp)


def base_weight_bytes(config, element: int, fp8: bool = False, tp: int = 1) -> int:
    """Bytes a decode step reads from the base weights on one GPU (rank 0's shard, with `tp` ranks): every
    layer, the final norm, the LM head (vocabulary-parallel; the embedding's rows are looked up, not read
    whole). With `fp8` the projections take one byte a weight plus a float32 scale per output row. Counted
    on the engine's own model (that rank's), built on the meta device."""
    from engine.model.layers.context import BuildContext, Fp8Settings
    from engine.model.layers.sharding import TensorParallel
    from engine.model.registry import model_class

    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[element]
    fp8_settings = Fp8Settings("fp8 (on the fly)") if fp8 else None
    context = BuildContext(dtype, torch.device("meta"), TensorParallel(0, tp), fp8_settings, max_positions=1)
    model = model_class(config)(config, context)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    return total - (0 if model.lm_head.weight is None else embed.numel() * embed.element_size())


def kv_bytes_per_token(config, element: int, tp: int = 1) -> int:
    """K and V of one token over all layers on one GPU, its KV heads (Gemma's local layers keep it too:
    W1's sequences fit their window, so each step reads every cached token of every layer)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = shard_plan(config, tp).kv_heads_per_rank
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element


def adapter_bytes(config, rank: int, element: int, tp: int = 1) -> int:
    """One adapter's A and B on one GPU: a column-parallel projection's A is whole and its B split, a
    row-parallel one's A split and its B whole (engine/parallel/lora_shards.py): the (in, out) of the
    rank's shard of each projection."""
    local = shard_plan(config, tp).local_shape
    dims = [local.module_dims(m) for m in local.targets]
    return element * config.num_hidden_layers * sum(rank * (i + o) for i, o in dims)


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
