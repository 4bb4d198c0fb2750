"""The engine's settings, declared once: each field's default, choices, `loraserve serve` flag and help.

Torch-free (`tests/test_layout.py` checks it), so the server's settings (`loraserve.settings.ServerSettings`)
embed these fields and `loraserve serve` derives its flags, LORASERVE_* variables and `--help` from them
(`loraserve.cli`); `engine.config.EngineConfig` adds the model and what needs torch. A new engine setting
is one field here: the flag, the variable and the server's copy follow. The checks here raise ValueError
naming the setting as `label` names it (the field here, the flag in the server).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from engine.kv_events.config import KVEventsConfig
from engine.spec_decode.config import SpeculativeConfig

GiB = 1 << 30

# Compute dtypes by name ("auto": float32 on the CPU, the checkpoint's on CUDA); engine.config maps them to torch's.
DTYPES = ("float32", "float", "float16", "half", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# "auto": K/V in the model dtype; "fp8" and "fp8_e4m3" (vLLM's two names for one thing): float8 e4m3
# with a float32 scale per layer for K and one for V (engine/model/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Where adapter loads run: "process" (whole, in spawned loader processes, so loads never compete with
# the engine thread for the GIL), "thread" (the manager's worker threads), or "auto" (processes on
# CUDA, threads on the CPU). engine/lora/background_loads.py.
ADAPTER_LOADERS = ("auto", "thread", "process")
# vLLM's --generation-config: "auto" takes unset sampling fields from the model's generation_config.json,
# "vllm" ignores the file (engine/generation_config.py).
GENERATION_CONFIGS = ("auto", "vllm")
# Which waiting request runs next: "fair" (virtual token counters by tenant, engine/fairness.py),
# "fcfs" (arrival order, ignoring tenants) or "priority" (vLLM's: each request's priority, then arrival).
# vLLM's option name; each is a class in engine/scheduling_policies/.
SCHEDULING_POLICIES = ("fair", "fcfs", "priority")
# None: the checkpoint as it is; "fp8": the linear projections as float8 e4m3 (engine/model/fp8_checkpoint.py).
QUANTIZATIONS = (None, "fp8")
# How FP8 projections multiply (engine/model/fp8_linear.py).
FP8_GEMMS = ("auto", "scaled_mm", "dequant")
# vLLM's load_format: "auto" reads the checkpoint, "dummy" makes random weights of its shapes.
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class Flag:
    """How a setting appears on `loraserve serve`'s command line; its variable is LORASERVE_<NAME>."""

    help: str | None = None  # argparse help; %(default)s shows the setting's default
    name: str | None = None  # without dashes; None: the field's name with '-' for '_'
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text -> value; None: the field's type
    action: str | None = None  # "store_true": an on-only switch (bools are --x/--no-x otherwise)
    nargs: str | None = None


def setting(
    default: Any,
    *,
    flag: Flag | None = None,
    choices: tuple | None = None,
    why: str = "",
    secret: bool = False,
) -> Any:
    """A settings field: its default, its flag (None: not on the command line), the values it may take,
    what its error message adds after them, and whether it is a secret (never in a repr, so never logged)."""
    return field(default=default, repr=not secret, metadata={"flag": flag, "choices": choices, "why": why})


def flag_of(f: Field) -> Flag | None:
    return f.metadata.get("flag")


def flag_name(f: Field) -> str:
    """`--max-loras` for max_loras (the flag's own name where it has one)."""
    flag = flag_of(f)
    return "--" + (flag.name if flag is not None and flag.name else f.name.replace("_", "-"))


def parse_gib(raw: str) -> int:
    """`--cpu-kv-cache-space` counts GiB; the setting holds bytes."""
    value = float(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB (got {raw})")
    return int(value * GiB)


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Limits and sizes of one engine (vLLM's names where they exist); checked in `__post_init__`."""

    dtype: str = setting("auto", flag=Flag("auto, float32, float16 or bfloat16"))
    device: str = setting("auto", flag=Flag("auto (cuda if present), cuda, cuda:1, cpu"))
    max_num_seqs: int = setting(64, flag=Flag("most sequences in one batch"))
    max_num_batched_tokens: int = setting(2048, flag=Flag("most tokens in one step"))
    # None: the model's `max_position_embeddings`, resolved by the engine when the model is known.
    max_model_len: int | None = setting(None, flag=Flag("context length (default: the model's)"))
    block_size: int = setting(16, flag=Flag("tokens per KV cache block"))
    gpu_memory_utilization: float = setting(0.9, flag=Flag("share of GPU memory to use, model included"))
    # "auto": the model dtype; "fp8" / "fp8_e4m3": half the bytes of bf16 per token (see KV_CACHE_DTYPES).
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        why="; 'fp8' stores K/V as float8 e4m3 with a per-tensor scale",
        flag=Flag(
            "auto: the model dtype; fp8 (= fp8_e4m3): float8 e4m3 K/V with per-layer scales from the "
            "checkpoint (else 1.0), twice the tokens of a bf16 cache"
        ),
    )
    # "fp8": the seven linear projections as float8 e4m3 with per-output-channel scales, quantized at load
    # (engine/model/fp8_linear.py). None: as the checkpoint is; an FP8 checkpoint is served as FP8 anyway.
    quantization: str | None = setting(
        None,
        choices=QUANTIZATIONS,
        why="; 'fp8' stores the linear projections as float8 e4m3 with per-channel scales",
        flag=Flag(
            "fp8: the linear projections as float8 e4m3 with per-channel scales, quantized at load "
            "(FP8 checkpoints are detected from config.json and served as FP8 without it)"
        ),
    )
    # GPUs one model is split over (Megatron-style, engine/parallel/): one worker process per rank beyond
    # the first; NCCL on CUDA, gloo on the CPU. 1: no worker, no collective.
    tensor_parallel_size: int = setting(
        1,
        flag=Flag(
            "GPUs of this host one model is split over (Megatron-style, one worker process per GPU "
            "beyond the first); 1: one GPU"
        ),
    )
    # Under tensor parallelism on CUDA: each row-parallel all-reduce of a decode-sized step (o_proj,
    # down_proj, a MoE block) fused with the residual add and RMSNorm after it, one kernel over the GPUs'
    # peer-to-peer memory instead of NCCL's all-reduce and the norm's kernel (engine/parallel/
    # fused_allreduce.py; larger inputs keep NCCL). vLLM's custom all-reduce (disable_custom_all_reduce).
    # Off by default: its kernel tests pass on two H100s, but the engine runs with it on (tp 2 tokens, tp 4,
    # the 70B step) are not measured yet. No effect at tensor_parallel_size 1 or on the CPU.
    fused_allreduce: bool = setting(
        False,
        flag=Flag(
            "tensor parallelism on CUDA: fuse each decode-sized all-reduce with the residual add and "
            "RMSNorm after it (one peer-to-peer kernel instead of NCCL + the norm); larger inputs keep NCCL"
        ),
    )
    # vLLM's load_format: "auto" reads the checkpoint's safetensors; "dummy" fills the weights with random
    # values on the device and reads none (benchmarks of a model's shape; config.json is all it needs).
    load_format: str = setting(
        "auto",
        choices=LOAD_FORMATS,
        flag=Flag(
            "auto: read the checkpoint; dummy: random weights of its shapes, made on the "
            "device (benchmarks; only config.json is read)"
        ),
    )
    # vLLM's enable_expert_parallel: a mixture of experts' layers hold whole experts per rank (experts
    # [r E/n, (r+1) E/n) on rank r) instead of a slice of every expert; attention stays tensor-parallel.
    # No effect on a dense model or at tensor_parallel_size 1.
    enable_expert_parallel: bool = setting(
        False,
        flag=Flag(
            "mixture-of-experts models: whole experts per GPU instead of a slice of every expert "
            "(attention stays tensor-parallel); with --tensor-parallel-size above 1"
        ),
    )
    # vLLM's speculative_config: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    # as a dict, JSON text or SpeculativeConfig (engine/spec_decode/config.py); None: no speculation.
    # With it, the engine turns async_scheduling off: each step's kept tokens decide the next step.
    speculative_config: SpeculativeConfig | dict | str | None = setting(
        None,
        flag=Flag(
            'speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": 4} (docs/OPERATIONS.md, "Speculative decoding")',
            metavar="JSON",
        ),
    )
    # vLLM's kv_events_config: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", ...} as a dict,
    # JSON text or KVEventsConfig (engine/kv_events/config.py): the prefix cache's changes published over
    # ZeroMQ for cluster routers. None: no events.
    kv_events_config: KVEventsConfig | dict | str | None = setting(
        None,
        flag=Flag(
            'KV-cache events for cluster routers, vLLM\'s keys: {"enable_kv_cache_events": true, '
            '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv@POD@MODEL"} '
            '(docs/OPERATIONS.md, "KV events")',
            metavar="JSON",
        ),
    )
    enable_prefix_caching: bool = setting(True, flag=Flag())
    # Adapters that lose their GPU slot keep a copy in idle KV-cache blocks, brought back by a copy on the
    # device; a request's allocation takes those blocks at once (engine/lora/kv_tier.py). Off under tensor
    # parallelism. One staging buffer of a max-rank adapter is its only fixed cost. Off by default: its
    # saves take the least recently used free blocks, prefix-cached ones included, before the same step's
    # allocations, and its effect on prefix-cache hits and mixed workloads is not measured yet.
    enable_adapter_kv_cache: bool = setting(
        False,
        flag=Flag(
            "keep adapters evicted from GPU slots in idle KV-cache blocks, so they come back by a copy on "
            "the GPU; requests take the blocks back at once, but the copies push cached prefixes out "
            "sooner (off by default; off under tensor parallelism)"
        ),
    )
    # CUDA: the KV cache takes the whole gpu_memory_utilization budget, past what max_num_seqs sequences of
    # max_model_len tokens can use (the default stops there); the extra blocks hold adapters (the KV tier)
    # and keep prefixes longer. Off by default: a second engine in the same process or on the same GPU
    # finds no room left.
    kv_cache_whole_budget: bool = setting(
        False,
        flag=Flag(
            "CUDA: give the KV cache the whole --gpu-memory-utilization budget, not only what --max-num-seqs "
            "sequences of --max-model-len tokens can use; the extra blocks hold evicted adapters (the KV "
            "tier) and cached prefixes"
        ),
    )
    # True: every step runs eagerly; False: decode-only steps replay CUDA graphs captured at start-up
    # (CUDA with the Triton attention backend only; the CPU always runs eagerly).
    enforce_eager: bool = setting(False, flag=Flag("run every step eagerly: no CUDA graphs for decode steps"))
    # With CUDA graphs on (not enforce_eager): steps holding prefill tokens, up to 2048 tokens, replay
    # piecewise graphs, everything but attention captured per token-count bucket (engine/piecewise_graphs.py);
    # False: such steps run eagerly. Tensor parallelism always runs them eagerly. Off by default until its
    # GPU tests pass (CPU-checked through the uncaptured pieces; the first GPU run stopped at a capture bug).
    piecewise_cuda_graphs: bool = setting(
        False,
        flag=Flag(
            "replay mixed prefill/decode steps as piecewise CUDA graphs, attention eager between the "
            "pieces (off by default: such steps run eagerly)"
        ),
    )
    # True: schedule and launch each step before reading the previous step's sampled tokens (they reach
    # the next step's inputs on the device), so host bookkeeping overlaps the GPU; step() then returns
    # one step late. A request that ends on a stop token costs one wasted row in the next step. On by
    # default: on an H100 it halves the decode step at batch 128 (docs/BENCHMARKS.md).
    async_scheduling: bool = setting(
        True,
        flag=Flag(
            "schedule and launch each step before reading the previous step's tokens, so the host's "
            "bookkeeping overlaps the GPU (--no-async-scheduling: one step at a time)"
        ),
    )
    # "auto": the Triton kernels on CUDA, plain torch on the CPU; "torch" is the reference path everywhere.
    attention_backend: str = setting(
        "auto",
        choices=ATTENTION_BACKENDS,
        flag=Flag(
            "auto: triton on CUDA, torch elsewhere; torch is the plain reference path (no CUDA graphs)"
        ),
    )
    max_loras: int = setting(4, flag=Flag("adapters resident on the GPU at once"))
    # Adapters kept on the host, ready to copy into a GPU slot; None: as many as max_loras.
    max_cpu_loras: int | None = setting(
        None, flag=Flag("adapters kept ready in host memory (default: --max-loras)")
    )
    # GPU slots (and as many CPU-tier rows) with room for an adapter's own embedding and LM head
    # (modules_to_save, LoRA on embed_tokens / lm_head): 2 x vocab x hidden each, on the GPU (counted in
    # gpu_memory_utilization, before the KV cache; split by vocabulary over tensor-parallel ranks) and in
    # host memory. 0: such adapters are refused.
    max_vocab_loras: int = setting(
        0,
        flag=Flag(
            "GPU slots (and CPU-tier rows) for adapters with their own embedding or LM head "
            "(modules_to_save, LoRA on embed_tokens/lm_head), each 2 x vocab x hidden; 0 refuses them "
            "(default %(default)s)"
        ),
    )
    max_lora_rank: int = setting(16, flag=Flag("largest adapter rank accepted"))
    # vLLM's --max-logprobs: the most top log-probabilities (logprobs, prompt_logprobs) a request may ask
    # for; -1: the whole vocabulary (then a request's -1 is allowed).
    max_logprobs: int = setting(
        20,
        flag=Flag(
            "the most top logprobs (logprobs, top_logprobs, prompt_logprobs) a request may ask for; -1: no "
            "cap, so -1 (the whole vocabulary) is allowed (vLLM's flag)"
        ),
    )
    # Rank rows the GPU adapter pool holds, summed over resident adapters (each rounded up to pages of 8
    # rows; engine/lora/pool.py). None: max_loras * max_lora_rank, so max_loras adapters of any rank fit.
    # Smaller: small adapters fill it and fewer large ones fit (at least one of max_lora_rank always does);
    # the rest of the memory goes to the KV cache.
    lora_pool_rank_budget: int | None = setting(
        None,
        flag=Flag(
            "rank rows of the GPU adapter pool, summed over resident adapters (pages of 8): each adapter "
            "takes what its rank needs (default: max-loras x max-lora-rank, so max-loras adapters of any "
            "rank fit); smaller leaves the rest to the KV cache"
        ),
    )
    adapter_loader: str = setting(
        "auto",
        choices=ADAPTER_LOADERS,
        flag=Flag(
            "where adapter files are read: process (loader processes, off the engine's GIL), thread, or "
            "auto (process on CUDA, thread on the CPU)"
        ),
    )
    # Where unset sampling fields come from (see GENERATION_CONFIGS); read by LLM and the server.
    generation_config: str = setting(
        "auto",
        choices=GENERATION_CONFIGS,
        flag=Flag(
            "auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p, "
            "repetition_penalty) take the model's generation_config.json values; vllm: ignore that file"
        ),
    )
    scheduling_policy: str = setting(
        "fair",
        choices=SCHEDULING_POLICIES,
        flag=Flag(
            "fair: tenants share the GPU by weight (virtual token counters); fcfs: first come first served; "
            "priority: each request's priority field (lower first), then arrival"
        ),
    )
    # CPU only: bytes of KV cache when num_kv_blocks is not given (vLLM's VLLM_CPU_KVCACHE_SPACE, in GiB).
    cpu_kv_cache_bytes: int = setting(
        GiB,
        flag=Flag(
            "GiB of KV cache when running on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)",
            name="cpu-kv-cache-space",
            parse=parse_gib,
        ),
    )
    # Structured outputs' grammars compile on threads of their own, off the step loop; a request whose
    # grammar is still compiling this long after it started fails as too complex (a 400 for the caller).
    grammar_compile_threads: int = setting(
        2, flag=Flag("threads in the engine core that compile structured-output grammars, off its step loop")
    )
    grammar_compile_timeout_s: float = setting(
        10.0,
        flag=Flag(
            "a structured-output grammar still compiling after this fails its requests with a 400 "
            "(structured_output_too_complex); schemas are also bounded in depth, size and enum values",
            name="grammar-compile-timeout",
            metavar="SECONDS",
        ),
    )
    # Not on the command line:
    # Explicit KV-cache size in blocks; overrides gpu_memory_utilization (tests use tiny values).
    num_kv_blocks: int | None = None
    enable_chunked_prefill: bool = True
    seed: int = 0
    # Cost of a token in the fair scheduler's counters: prompt tokens (charged when a request is first
    # admitted) and generated tokens (charged as scheduled) weigh differently, as in VTC.
    fairness_prompt_token_weight: float = 1.0
    fairness_output_token_weight: float = 2.0
    # Steps a request that lacks room (KV blocks; the token budget without chunked prefill) or an adapter
    # slot (max_loras) may be passed over for others before admission waits for it (bounded starvation).
    fairness_max_bypass_steps: int = 4
    # "auto" picks torch._scaled_mm where the GPU can, else "dequant" (the weight dequantized to the model
    # dtype for each GEMM; the CPU and the reference).
    fp8_gemm: str = setting("auto", choices=FP8_GEMMS)

    def __post_init__(self) -> None:
        check_engine_args(self)

    def label(self, name: str) -> str:
        """How an error message names a setting: its field name (the server names its flag)."""
        return name

    def not_a_choice(self, name: str, value: object, choices: tuple) -> str:
        """The error for a value outside a setting's choices."""
        allowed = (
            "None or " + " or ".join(repr(c) for c in choices if c is not None)
            if None in choices
            else "one of " + ", ".join(choices)
        )
        return f"{name} must be {allowed} (got {value!r})"

    def engine_args(self) -> dict[str, Any]:
        """The engine's settings of this object, by field name (what EngineConfig takes besides the model)."""
        return {f.name: getattr(self, f.name) for f in fields(EngineArgs)}


def check_engine_args(args: EngineArgs) -> None:
    """Every check of the engine's settings that needs no torch; ValueError naming the setting as
    `args.label` does."""
    label = args.label
    for f in fields(EngineArgs):
        choices = f.metadata.get("choices")
        value = getattr(args, f.name)
        if choices is not None and value not in choices:
            raise ValueError(args.not_a_choice(f.name, value, choices) + f.metadata["why"])
    for name in ("speculative_config", "kv_events_config"):
        try:
            {"speculative_config": SpeculativeConfig, "kv_events_config": KVEventsConfig}[name].parse(
                getattr(args, name)
            )
        except ValueError as exc:
            raise ValueError(f"{label(name)}: {exc}") from None
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "max_loras",
        "max_lora_rank",
        "cpu_kv_cache_bytes",
    ):
        _positive(label(name), getattr(args, name))
    if (
        isinstance(args.max_logprobs, bool)
        or not isinstance(args.max_logprobs, int)
        or args.max_logprobs < -1
    ):
        raise ValueError(
            f"{label('max_logprobs')} must be -1 (no cap) or a non-negative integer (got {args.max_logprobs!r})"
        )
    _positive(label("tensor_parallel_size"), args.tensor_parallel_size)
    _positive(label("grammar_compile_threads"), args.grammar_compile_threads)
    if not args.grammar_compile_timeout_s > 0:
        raise ValueError(
            f"{label('grammar_compile_timeout_s')} must be a positive number of seconds "
            f"(got {args.grammar_compile_timeout_s})"
        )
    for name, floor, why in (
        ("lora_pool_rank_budget", "max_lora_rank", ": the pool must hold one adapter of the largest rank"),
        ("max_cpu_loras", "max_loras", ""),
    ):
        value = getattr(args, name)
        if value is not None:  # None: as large as `floor` allows
            _positive(label(name), value)
            if value < getattr(args, floor):
                raise ValueError(
                    f"{label(name)} ({value}) must be at least {label(floor)} ({getattr(args, floor)}){why}"
                )
    vocab = args.max_vocab_loras
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise ValueError(f"{label('max_vocab_loras')} must be an integer (got {vocab!r})")
    if not 0 <= vocab <= args.max_loras:
        raise ValueError(
            f"{label('max_vocab_loras')} ({vocab}) must be from 0 to {label('max_loras')} ({args.max_loras})"
        )
    if args.max_model_len is not None:
        _positive(label("max_model_len"), args.max_model_len)
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < args.max_model_len:
            raise ValueError(
                f"{label('max_num_batched_tokens')} ({args.max_num_batched_tokens}) is smaller than "
                f"{label('max_model_len')} ({args.max_model_len}) with chunked prefill off: long prompts could "
                f"never be scheduled; raise {label('max_num_batched_tokens')} or enable chunked prefill"
            )
    if args.num_kv_blocks is not None and args.num_kv_blocks < 2:
        raise ValueError(f"{label('num_kv_blocks')} must be at least 2 (got {args.num_kv_blocks})")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"{label('gpu_memory_utilization')} must be in (0, 1] (got {args.gpu_memory_utilization})"
        )
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise ValueError(f"{label('dtype')} must be 'auto' or one of {sorted(DTYPES)} (got {args.dtype!r})")
    for name in ("fairness_prompt_token_weight", "fairness_output_token_weight"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{label(name)} must be a positive number (got {value!r})")
    bypass = args.fairness_max_bypass_steps
    if isinstance(bypass, bool) or not isinstance(bypass, int) or bypass < 0:
        raise ValueError(
            f"{label('fairness_max_bypass_steps')} must be a non-negative integer (got {bypass!r})"
        )
    for name in ("enforce_eager", "piecewise_cuda_graphs", "async_scheduling"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"{label(name)} must be a bool (got {getattr(args, name)!r})")
    if not isinstance(args.enable_expert_parallel, bool):
        raise ValueError(
            f"{label('enable_expert_parallel')} must be true or false (got {args.enable_expert_parallel!r})"
        )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")
