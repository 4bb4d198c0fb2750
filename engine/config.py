"""The engine's one validated configuration (vLLM's names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_events.config import KVEventsConfig
from engine.model.fp8_checkpoint import QUANTIZATIONS
from engine.model.fp8_linear import FP8_GEMMS
from engine.model.kv_quant import FP8_DTYPE
from engine.model.layers.context import LOAD_FORMATS
from engine.spec_decode.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

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


@dataclass(frozen=True)
class EngineConfig:
    """Limits and sizes of one engine instance; every field is checked in `__post_init__`."""

    model: str
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the model's `max_position_embeddings`, resolved by the engine when the model is known.
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # Explicit KV-cache size in blocks; overrides gpu_memory_utilization (tests use tiny values).
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_loras: int = 4
    max_lora_rank: int = 16
    # vLLM's --max-logprobs: the most top log-probabilities (logprobs, prompt_logprobs) a request may ask
    # for; -1: the whole vocabulary (then a request's -1 is allowed).
    max_logprobs: int = 20
    # Rank rows the GPU adapter pool holds, summed over resident adapters (each rounded up to pages of 8
    # rows; engine/lora/pool.py). None: max_loras * max_lora_rank, so max_loras adapters of any rank fit.
    # Smaller: small adapters fill it and fewer large ones fit (at least one of max_lora_rank always does);
    # the rest of the memory goes to the KV cache.
    lora_pool_rank_budget: int | None = None
    # Adapters kept on the host, ready to copy into a GPU slot; None: as many as max_loras.
    max_cpu_loras: int | None = None
    # GPU slots (and as many CPU-tier rows) with room for an adapter's own embedding and LM head
    # (modules_to_save, LoRA on embed_tokens / lm_head): 2 x vocab x hidden each, on the GPU (counted in
    # gpu_memory_utilization, before the KV cache) and in host memory. 0: such adapters are refused.
    max_vocab_loras: int = 0
    adapter_loader: str = "auto"  # see ADAPTER_LOADERS
    # "auto": float32 on the CPU, the checkpoint's dtype (bf16 for fp32 checkpoints) on CUDA.
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    # "auto": the Triton kernels on CUDA, plain torch on the CPU; "torch" is the reference path everywhere.
    attention_backend: str = "auto"
    # True: every step runs eagerly; False: decode-only steps replay CUDA graphs captured at start-up
    # (CUDA with the Triton attention backend only; the CPU always runs eagerly).
    enforce_eager: bool = False
    # "auto": the model dtype; "fp8" / "fp8_e4m3": half the bytes of bf16 per token (see KV_CACHE_DTYPES).
    kv_cache_dtype: str = "auto"
    # CPU only: bytes of KV cache when num_kv_blocks is not given (vLLM's VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_bytes: int = 1 << 30
    # True: schedule and launch each step before reading the previous step's sampled tokens (they reach
    # the next step's inputs on the device), so host bookkeeping overlaps the GPU; step() then returns
    # one step late. A request that ends on a stop token costs one wasted row in the next step. On by
    # default: on an H100 it halves the decode step at batch 128 (docs/BENCHMARKS.md).
    async_scheduling: bool = True
    # Where unset sampling fields come from (see GENERATION_CONFIGS); read by LLM and the server.
    generation_config: str = "auto"
    scheduling_policy: str = "fair"  # see SCHEDULING_POLICIES
    # Cost of a token in the fair scheduler's counters: prompt tokens (charged when a request is first
    # admitted) and generated tokens (charged as scheduled) weigh differently, as in VTC.
    fairness_prompt_token_weight: float = 1.0
    fairness_output_token_weight: float = 2.0
    # Steps a request that lacks room (KV blocks; the token budget without chunked prefill) or an adapter
    # slot (max_loras) may be passed over for others before admission waits for it (bounded starvation).
    fairness_max_bypass_steps: int = 4
    # "fp8": the seven linear projections as float8 e4m3 with per-output-channel scales, quantized at load
    # (engine/model/fp8_linear.py). None: as the checkpoint is; an FP8 checkpoint is served as FP8 anyway.
    quantization: str | None = None
    # How FP8 projections multiply (FP8_GEMMS): "auto" picks torch._scaled_mm where the GPU can, else
    # "dequant" (the weight dequantized to the model dtype for each GEMM; the CPU and the reference).
    fp8_gemm: str = "auto"
    # vLLM's load_format: "auto" reads the checkpoint's safetensors; "dummy" fills the weights with random
    # values on the device and reads none (benchmarks of a model's shape; config.json is all it needs).
    load_format: str = "auto"
    # GPUs one model is split over (Megatron-style, engine/parallel/): one worker process per rank beyond
    # the first; NCCL on CUDA, gloo on the CPU. 1: no worker, no collective.
    tensor_parallel_size: int = 1
    # vLLM's enable_expert_parallel: a mixture of experts' layers hold whole experts per rank (experts
    # [r E/n, (r+1) E/n) on rank r) instead of a slice of every expert; attention stays tensor-parallel.
    # No effect on a dense model or at tensor_parallel_size 1.
    enable_expert_parallel: bool = False
    # vLLM's speculative_config: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}
    # as a dict, JSON text or SpeculativeConfig (engine/spec_decode/config.py); None: no speculation.
    # With it, async_scheduling is turned off: each step's kept tokens decide the next step.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Structured outputs' grammars compile on threads of their own, off the step loop; a request whose
    # grammar is still compiling this long after it started fails as too complex (a 400 for the caller).
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 10.0
    # vLLM's kv_events_config: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", ...} as a dict,
    # JSON text or KVEventsConfig (engine/kv_events/config.py): the prefix cache's changes published over
    # ZeroMQ for cluster routers. None: no events.
    kv_events_config: KVEventsConfig | dict | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.speculative_config is not None and self.async_scheduling is True:
            # A step's kept tokens (1 to k + 1) must be known before the next step is scheduled, so
            # speculative decoding runs steps one at a time (vLLM v1 started so too).
            object.__setattr__(self, "async_scheduling", False)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or self.max_logprobs < -1
        ):
            raise ValueError(
                f"max_logprobs must be -1 (no cap) or a non-negative integer (got {self.max_logprobs!r})"
            )
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be true or false (got {self.enable_expert_parallel!r})"
            )
        _positive("grammar_compile_threads", self.grammar_compile_threads)
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be a positive number of seconds (got {self.grammar_compile_timeout_s})"
            )
        if self.lora_pool_rank_budget is not None:
            _positive("lora_pool_rank_budget", self.lora_pool_rank_budget)
            if self.lora_pool_rank_budget < self.max_lora_rank:
                raise ValueError(
                    f"lora_pool_rank_budget ({self.lora_pool_rank_budget}) must be at least max_lora_rank "
                    f"({self.max_lora_rank}): the pool must hold one adapter of the largest rank"
                )
        if self.max_cpu_loras is not None:
            _positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
                )
        if isinstance(self.max_vocab_loras, bool) or not isinstance(self.max_vocab_loras, int):
            raise ValueError(f"max_vocab_loras must be an integer (got {self.max_vocab_loras!r})")
        if not 0 <= self.max_vocab_loras <= self.max_loras:
            raise ValueError(
                f"max_vocab_loras ({self.max_vocab_loras}) must be from 0 to max_loras ({self.max_loras})"
            )
        if self.max_vocab_loras and self.tensor_parallel_size > 1:
            raise ValueError(
                "max_vocab_loras (adapters with their own embedding or LM head) is not supported with "
                "tensor_parallel_size > 1 yet: the vocabulary-sharded copies are not built"
            )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}) with chunked prefill off: long prompts could never be scheduled; "
                    "raise max_num_batched_tokens or enable chunked prefill"
                )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (got {self.num_kv_blocks})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)} (got {self.dtype!r})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} (got {self.attention_backend!r})"
            )
        if self.adapter_loader not in ADAPTER_LOADERS:
            raise ValueError(
                f"adapter_loader must be one of {', '.join(ADAPTER_LOADERS)} (got {self.adapter_loader!r})"
            )
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"generation_config must be one of {', '.join(GENERATION_CONFIGS)} (got {self.generation_config!r})"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)} (got {self.scheduling_policy!r})"
            )
        for name in ("fairness_prompt_token_weight", "fairness_output_token_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number (got {value!r})")
        max_bypass = self.fairness_max_bypass_steps
        if isinstance(max_bypass, bool) or not isinstance(max_bypass, int) or max_bypass < 0:
            raise ValueError(f"fairness_max_bypass_steps must be a non-negative integer (got {max_bypass!r})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {self.kv_cache_dtype!r}); "
                "'fp8' stores K/V as float8 e4m3 with a per-tensor scale"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or 'fp8' (got {self.quantization!r}); 'fp8' stores the linear "
                "projections as float8 e4m3 with per-channel scales"
            )
        if self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"fp8_gemm must be one of {', '.join(FP8_GEMMS)} (got {self.fp8_gemm!r})")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)} (got {self.load_format!r})"
            )
        for name in ("enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (got {getattr(self, name)!r})")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from None

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def loads_in_processes(self) -> bool:
        """Whether adapters are read in loader processes (see ADAPTER_LOADERS)."""
        if self.adapter_loader == "auto":
            return self.torch_device.type == "cuda"
        return self.adapter_loader == "process"

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_attention_backend(self) -> str:
        """The backend in use ("torch" or "triton"): auto picks Triton on CUDA, torch elsewhere."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.torch_device.type == "cuda" else "torch"

    @property
    def use_cuda_graphs(self) -> bool:
        return (
            not self.enforce_eager
            and self.torch_device.type == "cuda"
            and self.resolved_attention_backend == "triton"
        )

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The compute dtype: explicit, or chosen from the device and the checkpoint."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype K/V are stored in: the model's, or float8 e4m3 for "fp8"."""
        return model_dtype if self.kv_cache_dtype == "auto" else FP8_DTYPE


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")
