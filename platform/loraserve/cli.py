"""`loraserve serve` (the server, under uvicorn) and the admin client commands (`loraserve adapters|routes`).

Every serve flag can also come from the environment: `--max-loras` from `LORASERVE_MAX_LORAS`,
`--lora-modules` from `LORASERVE_LORA_MODULES` (space or comma separated), booleans as
true/false/1/0/yes/no. A flag on the command line wins over its variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from adapters_store.config import parse_size
from loraserve.http_server import run_app
from loraserve.inference.tools import PARSERS
from loraserve.ops.http_timeouts import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
)
from loraserve.settings import (
    ADAPTER_LOADERS,
    ATTENTION_BACKENDS,
    DEFAULT_ADAPTER_STORE,
    DEFAULT_STATE_DIR,
    GENERATION_CONFIGS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    METRICS_OFF,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    ServerSettings,
    parse_lora_module,
)

ENV_PREFIX = "LORASERVE_"
IMAGE_VARIANT_ENV = "IMAGE_VARIANT"  # cuda or cpu, set by deploy/Dockerfile
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SERVE_FIELDS = (
    "model",
    "served_model_name",
    "host",
    "port",
    "root_path",
    "dtype",
    "device",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "block_size",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "quantization",
    "tensor_parallel_size",
    "load_format",
    "enable_expert_parallel",
    "speculative_config",
    "kv_events_config",
    "enable_prefix_caching",
    "enforce_eager",
    "async_scheduling",
    "attention_backend",
    "max_loras",
    "max_cpu_loras",
    "max_vocab_loras",
    "adapter_loader",
    "generation_config",
    "max_lora_rank",
    "max_logprobs",
    "enable_prompt_tokens_details",
    "enable_force_include_usage",
    "enable_server_load_tracking",
    "return_tokens_as_token_ids",
    "lora_pool_rank_budget",
    "allowed_lora_paths",
    "adapter_store",
    "adapter_cache_max_bytes",
    "adapter_cache_min_free_bytes",
    "max_concurrent_uploads_per_tenant",
    "max_routes_per_tenant",
    "config_store",
    "api_keys",
    "shutdown_timeout",
    "max_concurrent_requests_per_tenant",
    "scheduling_policy",
    "state_dir",
    "metrics_port",
    "metrics_host",
    "metrics_key",
    "placement_key",
    "adapter_lookup_ttl",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "tokenizer_pool_size",
    "max_request_body_size",
    "http_header_timeout",
    "http_body_timeout",
    "http_body_min_rate",
    "grammar_compile_threads",
    "grammar_compile_timeout",
    "api_server_count",
    "serving_warmup",
    "serving_warmup_timeout",
    "engine_core_cpus",
)
GiB = 1 << 30


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--model",
        help="local folder or Hugging Face id of a supported model: Llama, Mistral, Qwen2/3, Gemma 2/3, "
        "Phi-3/4 (docs/MODELS.md; default: the bundled demo, "
        "SmolLM2-135M-Instruct, converted once under STATE_DIR/models)",
    )
    add("--served-model-name", help="the base model's name in requests and /v1/models (default: --model)")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    add("--port", type=int, default=8000)
    add(
        "--root-path",
        default="",
        help="path prefix a proxy strips before forwarding (e.g. /llm), as vLLM's --root-path; "
        "links in the API schema carry it",
    )
    add("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    add("--device", default="auto", help="auto (cuda if present), cuda, cuda:1, cpu")
    add("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    add("--max-num-batched-tokens", type=int, default=2048, help="most tokens in one step")
    add("--max-model-len", type=int, help="context length (default: the model's)")
    add("--block-size", type=int, default=16, help="tokens per KV cache block")
    add(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use, model included"
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model dtype; fp8 (= fp8_e4m3): float8 e4m3 K/V with per-layer scales from the "
        "checkpoint (else 1.0), twice the tokens of a bf16 cache",
    )
    add(
        "--quantization",
        choices=[q for q in QUANTIZATIONS if q],
        help="fp8: the linear projections as float8 e4m3 with per-channel scales, quantized at load "
        "(FP8 checkpoints are detected from config.json and served as FP8 without it)",
    )
    add(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs of this host one model is split over (Megatron-style, one worker process per GPU "
        "beyond the first); 1: one GPU",
    )
    add(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="auto: read the checkpoint; dummy: random weights of its shapes, made on the "
        "device (benchmarks; only config.json is read)",
    )
    add(
        "--enable-expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="mixture-of-experts models: whole experts per GPU instead of a slice of every expert "
        "(attention stays tensor-parallel); with --tensor-parallel-size above 1",
    )
    add(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4} (docs/OPERATIONS.md, "Speculative decoding")',
    )
    add(
        "--kv-events-config",
        metavar="JSON",
        help='KV-cache events for cluster routers, vLLM\'s keys: {"enable_kv_cache_events": true, '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv@POD@MODEL"} '
        '(docs/OPERATIONS.md, "KV events")',
    )
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run every step eagerly: no CUDA graphs for decode steps",
    )
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and launch each step before reading the previous step's tokens, so the host's "
        "bookkeeping overlaps the GPU (--no-async-scheduling: one step at a time)",
    )
    add(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA, torch elsewhere; torch is the plain reference path (no CUDA graphs)",
    )
    add("--max-loras", type=int, default=4, help="adapters resident on the GPU at once")
    add("--max-cpu-loras", type=int, help="adapters kept ready in host memory (default: --max-loras)")
    add(
        "--max-vocab-loras",
        type=int,
        default=0,
        help="GPU slots (and CPU-tier rows) for adapters with their own embedding or LM head "
        "(modules_to_save, LoRA on embed_tokens/lm_head), each 2 x vocab x hidden; 0 refuses them (default 0)",
    )
    add("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    add(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most top logprobs (logprobs, top_logprobs, prompt_logprobs) a request may ask for; -1: no cap, "
        "so -1 (the whole vocabulary) is allowed (vLLM's flag)",
    )
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="answer usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache); "
        "off: null, as vLLM's flag",
    )
    add(
        "--enable-force-include-usage",
        action="store_true",
        help="usage in every streamed chunk and a usage chunk at the end of every stream, whatever "
        "stream_options asks (vLLM's flag)",
    )
    add(
        "--enable-server-load-tracking",
        action="store_true",
        help='GET /load answers {"server_load": N}, the completions and chat requests in flight (vLLM\'s flag)',
    )
    add(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name every token as token_id:N, as each request's return_tokens_as_token_ids does "
        "(vLLM's flag)",
    )
    add(
        "--lora-pool-rank-budget",
        type=int,
        help="rank rows of the GPU adapter pool, summed over resident adapters (pages of 8): each adapter "
        "takes what its rank needs (default: max-loras x max-lora-rank, so max-loras adapters of any rank "
        "fit); smaller leaves the rest to the KV cache",
    )
    add(
        "--adapter-loader",
        default="auto",
        choices=ADAPTER_LOADERS,
        help="where adapter files are read: process (loader processes, off the engine's GIL), thread, or "
        "auto (process on CUDA, thread on the CPU)",
    )
    add(
        "--generation-config",
        default="auto",
        choices=GENERATION_CONFIGS,
        help="auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p, repetition_penalty) take the model's "
        "generation_config.json values; vllm: ignore that file",
    )
    add(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT folders stored as the default tenant's adapters at start (skipped if unchanged)",
    )
    add(
        "--allowed-lora-paths",
        nargs="+",
        default=[],
        metavar="DIR",
        help="folders POST /v1/load_lora_adapter may load adapters from (vLLM's runtime loading); "
        "unset: runtime loading is off",
    )
    add(
        "--adapter-store",
        default=DEFAULT_ADAPTER_STORE,
        help="file:///dir, file://./dir or s3://bucket/prefix",
    )
    add(
        "--adapter-cache-max-bytes",
        type=_size,
        default=10 * GiB,
        metavar="SIZE",
        help="most bytes of adapter files kept in the local disk cache (STATE_DIR/cache/adapters), e.g. 10GiB "
        "or 500MiB; least recently used versions are evicted beyond it (default 10GiB)",
    )
    add(
        "--adapter-cache-min-free-bytes",
        type=_size,
        default=0,
        metavar="SIZE",
        help="free space the adapter cache leaves on its disk: cached versions are evicted to keep it, as they "
        "are whenever the disk is full (default 0: evict only when a write finds the disk full)",
    )
    add(
        "--max-concurrent-uploads-per-tenant",
        type=int,
        default=2,
        help="adapter uploads one tenant may run at once; more get 429 (default 2)",
    )
    add(
        "--max-routes-per-tenant",
        type=int,
        default=1000,
        help="A/B routes one tenant may hold; creating more gets 403 (default 1000)",
    )
    add("--config-store", help="redis://host:6379/0 (default: embedded, under STATE_DIR/config)")
    add(
        "--api-keys",
        help="JSON or YAML file: key -> {tenant, role: admin|user, max_concurrent_requests, weight, "
        "max_tokens_per_minute, cache_group}",
    )
    add("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    add(
        "--max-concurrent-requests-per-tenant",
        type=int,
        help="default per-tenant cap (keys may set their own)",
    )
    add(
        "--scheduling-policy",
        default="fair",
        choices=SCHEDULING_POLICIES,
        help="fair: tenants share the GPU by weight (virtual token counters); fcfs: first come first served",
    )
    add(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="demo model, embedded config, adapter cache, compiled kernels (Triton cache)",
    )
    add(
        "--cpu-kv-cache-space",
        type=float,
        default=1.0,
        help="GiB of KV cache when running on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)",
    )
    add(
        "--metrics-port",
        type=_metrics_port,
        help="port of the metrics listener, which serves only /metrics, /health and /ready, out of "
        "tenants' reach (default: --port + 1); off: none",
    )
    add("--metrics-host", help="address of the metrics listener (default: --host)")
    add(
        "--metrics-key",
        help="scrapers must send 'Authorization: Bearer KEY' for /metrics; with a key the main port "
        "serves /metrics too (prefer the environment variable LORASERVE_METRICS_KEY)",
    )
    add(
        "--placement-key",
        help="turns on the residency endpoints (/v1/residency: preload, pin, unpin adapters) on the "
        "metrics listener, for `loraserve placement`; callers send 'Authorization: Bearer KEY' "
        "(prefer the environment variable LORASERVE_PLACEMENT_KEY)",
    )
    add(
        "--adapter-lookup-ttl",
        type=float,
        default=30.0,
        help="seconds an adapter name's resolved version is trusted before the store is asked again "
        "(uploads and deletes reach every replica at once through the config store's events)",
    )
    add(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='vLLM\'s: tool_choice "auto" (the default when a request has tools) reads tool calls from the '
        "output with --tool-call-parser (adapters uploaded with a tool_call_parser use their own)",
    )
    add(
        "--tool-call-parser",
        help=f"the format models write tool calls in, by vLLM's names: {', '.join(PARSERS)} "
        '(docs/API.md, "Tool calling")',
    )
    add(
        "--tokenizer-pool-size",
        type=int,
        default=2,
        help="threads that tokenize prompts, render chat templates and check structured-output specs, "
        "off the event loop (default 2)",
    )
    add(
        "--max-request-body-size",
        type=int,
        metavar="BYTES",
        help="largest JSON request body, refused with 413 before it is parsed (default: 32 bytes per token "
        "of --max-model-len, at least 4 MiB; uploads have their own limit)",
    )
    add(
        "--http-header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a request's headers may take to arrive, from its first byte (slow clients get 408)",
    )
    add(
        "--http-body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body may take, plus one more for every --http-body-min-rate bytes "
        "received (slow clients get 408)",
    )
    add(
        "--http-body-min-rate",
        type=int,
        default=DEFAULT_BODY_MIN_RATE,
        metavar="BYTES_PER_S",
        help="the body rate that extends --http-body-timeout (default 16384: a large upload at a steady rate "
        "always finishes, a trickle does not)",
    )
    add(
        "--grammar-compile-threads",
        type=int,
        default=2,
        help="threads in the engine core that compile structured-output grammars, off its step loop",
    )
    add(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a structured-output grammar still compiling after this fails its requests with a 400 "
        "(structured_output_too_complex); schemas are also bounded in depth, size and enum values",
    )
    add(
        "--api-server-count",
        type=int,
        help="front-end (HTTP) processes behind the one port, each talking to the one engine core (vLLM's "
        "flag); default: 1 on the CPU, else (cores - 4) / 3 between 1 and 4 (docs/OPERATIONS.md)",
    )
    add(
        "--engine-core-cpus",
        default="auto",
        help="CPUs of the engine core's busy loop: auto (on CUDA hosts of 4+ cores, the last CPU for the "
        "loop and, from 8 cores, the one before for its other threads), off, or a list such as 14,15 "
        "(the loop on the first, its other threads on the rest); everything else runs elsewhere",
    )
    add(
        "--serving-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before /ready, send each server process's own request path a few small requests "
        "(completions and chat, streamed and not; tenant _warmup, not in the request metrics), so the "
        "first requests after /ready are not the slow ones (docs/OPERATIONS.md)",
    )
    add(
        "--serving-warmup-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a serving warm-up not done after this is logged as a warning, and the server turns ready",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _size(raw: str) -> int:
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _metrics_port(raw: str) -> int:
    if raw.strip().lower() in ("off", "none", "0"):
        return METRICS_OFF
    port = int(raw)
    if not 1 <= port <= 65535:
        raise ValueError("expected a port in 1..65535, or off")
    return port


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Make `LORASERVE_<FLAG>` the default of each flag, so the command line still wins."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = ENV_PREFIX + action.dest.upper()
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            action.default = _env_value(action, raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"{name}={raw!r}: {exc}")


def _env_value(action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse.BooleanOptionalAction):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise ValueError("expected true or false")
        return value in _TRUE
    convert = action.type or str
    if action.nargs == "+":
        return [convert(item) for item in raw.replace(",", " ").split()]
    if action.choices is not None and raw not in action.choices:
        raise ValueError(f"expected one of {', '.join(action.choices)}")
    return convert(raw)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    values = {name: getattr(args, name) for name in _SERVE_FIELDS}
    values["allowed_lora_paths"] = tuple(args.allowed_lora_paths)
    if args.cpu_kv_cache_space <= 0:
        raise ValueError(
            f"--cpu-kv-cache-space must be a positive number of GiB (got {args.cpu_kv_cache_space})"
        )
    return ServerSettings(
        **values, lora_modules=tuple(args.lora_modules), cpu_kv_cache_bytes=int(args.cpu_kv_cache_space * GiB)
    )


def serve(settings: ServerSettings, log_level: str = "info") -> int:
    """Run the server until SIGTERM (exit code 0) or until the engine core dies (1)."""
    from loraserve.app import create_app  # the app pulls in torch: only for `serve`
    from loraserve.frontends.placement import api_server_count, cpu_plan

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_device(settings.device, os.environ.get(IMAGE_VARIANT_ENV))
    if api_server_count(settings) > 1:  # a supervisor, the engine core and N front-end processes
        from loraserve.frontends.supervisor import Supervisor

        return Supervisor(settings, log_level).run()
    plan = cpu_plan(settings)
    if plan is not None:  # this process and what it starts stay off the engine core's CPUs
        from engine.core.steady import pin_process

        pin_process(plan.others)
    return run_app(create_app(settings), settings, log_level)


def check_device(device: str, image_variant: str | None) -> None:
    """Refuse --device cuda without a visible GPU, before anything loads (the CUDA image sets it, so it
    never quietly serves from the CPU); say so when this is the CPU image."""
    log = logging.getLogger("loraserve")
    if image_variant == "cpu":
        log.warning("this is the CPU image (no CUDA): fine for trying loraserve, slow for serving")
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        where = (
            "run the container with --gpus all (needs the NVIDIA Container Toolkit on the host), use the "
            "CPU image, or set LORASERVE_DEVICE=cpu"
            if image_variant
            else "pass --device cpu (or auto) to serve from the CPU"
        )
        raise SystemExit(f"--device {device}: no CUDA device is visible to this process; {where}")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve", description="Serve many LoRA adapters of one base model."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_arguments(serve_parser)
    apply_env_defaults(serve_parser, os.environ if environ is None else environ)
    _add_client_commands(commands)
    from loraserve.placement.command import add_placement_command  # httpx and prometheus_client only

    add_placement_command(
        commands, lambda p, _: apply_env_defaults(p, os.environ if environ is None else environ)
    )
    return parser


def _add_client_commands(commands: argparse._SubParsersAction) -> None:
    try:
        from loraserve.cli_client import add_client_commands
    except ImportError:  # the admin client is optional for `serve`
        return
    add_client_commands(commands)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            settings = settings_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        return serve(settings, args.log_level)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
