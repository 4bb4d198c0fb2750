"""The server's one validated configuration: every `loraserve serve` flag (vLLM's names where they exist).

Engine sizes are passed through to engine.EngineConfig, which checks them again; the checks here are
the ones the engine does not know about (URLs, files, the shape of `--lora-modules`), so a typo fails
at start with a message naming the flag instead of deep inside the lifespan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from adapter_format.names import NAME_RULE, is_valid_name
from adapters_store.config import DEFAULT_URL as DEFAULT_ADAPTER_STORE
from adapters_store.config import GiB, parse_store_url
from engine.core.steady import parse_cpus
from engine.kv_events.config import KVEventsConfig
from engine.spec_decode.config import SpeculativeConfig
from loraserve.inference.tools.parsers import PARSERS, unknown_parser_message
from loraserve.ops.http_timeouts import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
)

DEFAULT_STATE_DIR = Path(".loraserve")
# The engine's own choices (engine/config.py; a test keeps them equal), repeated so that `loraserve` client
# commands need not import torch.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model dtype; fp8 = fp8_e4m3: float8 e4m3 K/V
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA, torch elsewhere
ADAPTER_LOADERS = ("auto", "thread", "process")  # auto: loader processes on CUDA, threads elsewhere
GENERATION_CONFIGS = ("auto", "vllm")  # auto: the model's generation_config.json; vllm: ignore it
QUANTIZATIONS = (None, "fp8")  # None: the checkpoint as is; fp8: float8 e4m3 linear projections
LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint; dummy: random weights of its shapes, nothing read
METRICS_OFF = 0  # --metrics-port off
SCHEDULING_POLICIES = ("fair", "fcfs")  # fair: virtual token counters by tenant; fcfs: arrival order
# The default body limit: about 4 characters a token, JSON escapes (up to 6 bytes a character) and chat
# framing around them; 32 bytes a token of a 128k context is 4 MiB.
BODY_BYTES_PER_TOKEN = 32
DEFAULT_BODY_CONTEXT = 131072
MIN_DEFAULT_BODY_SIZE = 4 << 20
MIN_REQUEST_BODY_SIZE = 4096


@dataclass(frozen=True)
class ServerSettings:
    """Everything `loraserve serve` can be told; `create_app` reads only what it needs."""

    # None: the bundled demo model, converted once under ./.loraserve/models (see demo_model.py).
    model: str | None = None
    served_model_name: str | None = None  # the base model's id in requests; None: derived from `model`
    host: str = "127.0.0.1"
    port: int = 8000
    root_path: str = ""  # the prefix a path-routing proxy strips ("" when served at the root)
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # engine.EngineConfig.quantization
    tensor_parallel_size: int = 1  # engine.EngineConfig.tensor_parallel_size
    load_format: str = "auto"  # engine.EngineConfig.load_format (dummy: random weights)
    enable_expert_parallel: bool = False  # engine.EngineConfig.enable_expert_parallel
    # vLLM's --speculative-config: JSON text of engine.spec_decode.config.SpeculativeConfig; None: off
    speculative_config: str | None = None
    # vLLM's --kv-events-config: JSON text of engine.kv_events.config.KVEventsConfig; None: no KV events
    kv_events_config: str | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs
    async_scheduling: bool = True  # False: read each step's tokens before scheduling the next
    attention_backend: str = "auto"
    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_vocab_loras: int = 0  # engine.EngineConfig.max_vocab_loras
    adapter_loader: str = "auto"  # engine.config.ADAPTER_LOADERS
    generation_config: str = "auto"  # where unset sampling fields come from (GENERATION_CONFIGS)
    max_lora_rank: int = 16
    max_logprobs: int = 20  # vLLM's --max-logprobs (engine.EngineConfig.max_logprobs); -1: no cap
    # vLLM's usage flags: usage.prompt_tokens_details (cached_tokens) in answers; usage in every stream
    # chunk and a usage chunk at the end of every stream, whatever stream_options says
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_server_load_tracking: bool = False  # vLLM's: GET /load answers the requests in flight
    return_tokens_as_token_ids: bool = False  # vLLM's: every request's logprobs name tokens token_id:N
    lora_pool_rank_budget: int | None = None  # engine.EngineConfig.lora_pool_rank_budget
    # (name, local PEFT folder) pairs put into the default tenant's store at start.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Folders under which POST /v1/load_lora_adapter may read adapters; empty: runtime loading is off.
    allowed_lora_paths: tuple[str, ...] = ()
    adapter_store: str = DEFAULT_ADAPTER_STORE
    # The local disk cache of adapter files: its byte budget, and the free space to keep on its disk
    # (entries are evicted to keep it, and to make room when the disk is full).
    adapter_cache_max_bytes: int = 10 * GiB
    adapter_cache_min_free_bytes: int = 0
    # Adapter uploads one tenant may run at once (429 beyond), and A/B routes one tenant may hold (403 beyond).
    max_concurrent_uploads_per_tenant: int = 2
    max_routes_per_tenant: int = 1000
    config_store: str | None = None  # None: embedded under ./.loraserve/config
    api_keys: str | None = None  # JSON or YAML file of key -> {tenant, role}
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_concurrent_requests_per_tenant: int | None = None  # None: no default cap (keys may set their own)
    scheduling_policy: str = "fair"  # SCHEDULING_POLICIES
    # CPU only: KV cache bytes when the device is the CPU (tests pass small values).
    cpu_kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None  # explicit KV cache size in blocks (tests)
    state_dir: Path = field(default=DEFAULT_STATE_DIR)  # demo model, embedded config, disk cache
    # /metrics lives on a listener of its own, out of tenants' reach (docs/OPERATIONS.md, "Metrics").
    # None: --port + 1 (no listener when --port is 0 or 65535); METRICS_OFF: no listener.
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: --host
    # Scrapers send `Authorization: Bearer KEY` on /metrics; with a key the main port serves /metrics too.
    metrics_key: str | None = field(default=None, repr=False)  # a secret: never in logs
    # The operator's residency endpoints (/v1/residency..., for `loraserve placement`) on the metrics
    # listener need `Authorization: Bearer KEY`; None: they are off.
    placement_key: str | None = field(default=None, repr=False)
    # vLLM's: tool_choice "auto" parses calls in the output with this parser (inference/tools/parsers/);
    # adapters uploaded with a tool_call_parser of their own use theirs, with or without these flags.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Adapter lookups (name -> version) are checked against the store again after this many seconds;
    # uploads and deletes reach every replica at once as config events, so this only bounds a lost event.
    adapter_lookup_ttl: float = 30.0
    # Threads for tokenizing, chat templates and spec checks, off the event loop (loraserve/work_pool.py).
    tokenizer_pool_size: int = 2
    # Largest JSON request body in bytes, refused with 413 before it is parsed; None: request_body_limit's
    # default for the context length. Uploads have their own limit (the store's).
    max_request_body_size: int | None = None
    # Slow clients (ops/http_timeouts.py): seconds for a request's headers, seconds for its body plus one
    # more for every `http_body_min_rate` bytes that arrive.
    http_header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    http_body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    http_body_min_rate: int = DEFAULT_BODY_MIN_RATE
    # Structured outputs' grammars (engine.EngineConfig.grammar_compile_*): compile threads in the engine
    # core, and the seconds a compile may take before its requests fail as too complex.
    grammar_compile_threads: int = 2
    grammar_compile_timeout: float = 10.0
    # vLLM's --api-server-count: front-end (HTTP) processes behind the one port, each with its own
    # connection to the one engine core (docs/PROCESSES.md); None: from the host's cores
    # (loraserve.frontends.placement.default_api_server_count).
    api_server_count: int | None = None
    # Where the engine core's busy loop runs (engine.core.steady): auto, off, or a CPU list whose first
    # CPU runs the loop and the rest its other threads.
    engine_core_cpus: str = "auto"
    # Before /ready: a few requests through each server process's own request path
    # (loraserve.ops.serving_warmup), bounded by the timeout; off with --no-serving-warmup.
    serving_warmup: bool = True
    serving_warmup_timeout: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (got {self.port})")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 1..65535, or off (got {self.metrics_port})")
        if (
            self.metrics_listen_port is not None
            and self.metrics_listen_port == self.port
            and (self.metrics_host in (None, self.host))
        ):
            raise ValueError(
                f"--metrics-port {self.metrics_port} is the --port itself; pick another port, or off"
            )
        if self.metrics_key is not None and len(self.metrics_key) < 16:
            raise ValueError("--metrics-key must be at least 16 characters (a random token)")
        count = self.api_server_count
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"--api-server-count must be a positive integer (got {count!r})")
        if not self.serving_warmup_timeout > 0:
            raise ValueError(
                f"--serving-warmup-timeout must be a positive number of seconds (got {self.serving_warmup_timeout})"
            )
        if self.engine_core_cpus.strip().lower() not in ("auto", "off"):
            try:
                parse_cpus(self.engine_core_cpus)
            except ValueError as exc:
                raise ValueError(f"--engine-core-cpus: {exc}") from None
        if self.placement_key is not None:
            if len(self.placement_key) < 16:
                raise ValueError("--placement-key must be at least 16 characters (a random token)")
            if self.metrics_listen_port is None:
                raise ValueError(
                    "--placement-key needs the metrics listener, which serves the residency endpoints: "
                    "give --metrics-port a port"
                )
        if not self.adapter_lookup_ttl >= 0:
            raise ValueError(f"--adapter-lookup-ttl must be >= 0 seconds (got {self.adapter_lookup_ttl})")
        missing = [p for p in self.allowed_lora_paths if not Path(p).is_dir()]
        if missing:
            raise ValueError(f"--allowed-lora-paths: {missing[0]!r} is not a folder")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"--root-path must start with / and not end with one, e.g. /llm (got {self.root_path!r})"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; use one of "
                f"{', '.join(KV_CACHE_DTYPES)} (auto: the model dtype; fp8: float8 e4m3 with per-layer scales)"
            )
        if isinstance(self.tensor_parallel_size, bool) or not (
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1
        ):
            raise ValueError(
                f"--tensor-parallel-size must be a positive integer (got {self.tensor_parallel_size!r})"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format {self.load_format!r} is not supported; use one of {', '.join(LOAD_FORMATS)}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"--quantization {self.quantization!r} is not supported; use fp8 (float8 e4m3 weights with "
                "per-channel scales) or leave it out"
            )
        try:
            SpeculativeConfig.parse(self.speculative_config)
        except ValueError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None
        try:
            KVEventsConfig.parse(self.kv_events_config)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None
        if self.adapter_loader not in ADAPTER_LOADERS:
            raise ValueError(
                f"--adapter-loader {self.adapter_loader!r} is not supported; use one of {', '.join(ADAPTER_LOADERS)}"
            )
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(
                f"--generation-config {self.generation_config!r} is not supported; use one of "
                f"{', '.join(GENERATION_CONFIGS)}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy {self.scheduling_policy!r} is not supported; use one of "
                f"{', '.join(SCHEDULING_POLICIES)} (fair: share the GPU between tenants by weight)"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend {self.attention_backend!r} is not supported; use one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        try:
            parse_store_url(self.adapter_store)
        except ValueError as exc:
            raise ValueError(f"--adapter-store: {exc}") from None
        for flag, value, low in (
            ("--adapter-cache-max-bytes", self.adapter_cache_max_bytes, 1),
            ("--adapter-cache-min-free-bytes", self.adapter_cache_min_free_bytes, 0),
            ("--max-concurrent-uploads-per-tenant", self.max_concurrent_uploads_per_tenant, 1),
            ("--max-routes-per-tenant", self.max_routes_per_tenant, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low} (got {value!r})")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds (got {self.shutdown_timeout})")
        limit = self.max_concurrent_requests_per_tenant
        if limit is not None and limit < 1:
            raise ValueError(f"--max-concurrent-requests-per-tenant must be a positive integer (got {limit})")
        if self.api_keys is not None and not Path(self.api_keys).is_file():
            raise ValueError(f"--api-keys {self.api_keys!r} is not a file; give a JSON or YAML keys file")
        if isinstance(self.tokenizer_pool_size, bool) or self.tokenizer_pool_size < 1:
            raise ValueError(f"--tokenizer-pool-size must be at least 1 (got {self.tokenizer_pool_size})")
        if self.max_request_body_size is not None and self.max_request_body_size < MIN_REQUEST_BODY_SIZE:
            raise ValueError(
                f"--max-request-body-size must be at least {MIN_REQUEST_BODY_SIZE} bytes "
                f"(got {self.max_request_body_size})"
            )
        for flag, value in (
            ("--http-header-timeout", self.http_header_timeout),
            ("--http-body-timeout", self.http_body_timeout),
            ("--http-body-min-rate", self.http_body_min_rate),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be positive (got {value})")
        if isinstance(self.grammar_compile_threads, bool) or self.grammar_compile_threads < 1:
            raise ValueError(
                f"--grammar-compile-threads must be at least 1 (got {self.grammar_compile_threads})"
            )
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"--grammar-compile-timeout must be positive (got {self.grammar_compile_timeout})"
            )
        if self.max_logprobs < -1:
            raise ValueError(
                f"--max-logprobs must be -1 (no cap) or a non-negative integer (got {self.max_logprobs})"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(unknown_parser_message(self.tool_call_parser))
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                f"--enable-auto-tool-choice requires --tool-call-parser (one of {', '.join(PARSERS)})"
            )
        names = [name for name, _ in self.lora_modules]
        for name, path in self.lora_modules:
            if not is_valid_name(name):
                raise ValueError(f"--lora-modules: {name!r} is not a valid adapter name ({NAME_RULE})")
            if not Path(path).is_dir():
                raise ValueError(f"--lora-modules {name}={path}: {path!r} is not a PEFT adapter folder")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The server's parser for tool_choice "auto"; None unless --enable-auto-tool-choice is set."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def metrics_listen_port(self) -> int | None:
        """The metrics listener's port; None when there is none."""
        if self.metrics_port is None:
            return self.port + 1 if 0 < self.port < 65535 else None
        return self.metrics_port if self.metrics_port != METRICS_OFF else None

    @property
    def request_body_limit(self) -> int:
        """--max-request-body-size, else room for a whole context: BODY_BYTES_PER_TOKEN per token of
        --max-model-len (a model's own length is not known before it loads: DEFAULT_BODY_CONTEXT then),
        at least MIN_DEFAULT_BODY_SIZE."""
        if self.max_request_body_size is not None:
            return self.max_request_body_size
        context = self.max_model_len or DEFAULT_BODY_CONTEXT
        return max(MIN_DEFAULT_BODY_SIZE, context * BODY_BYTES_PER_TOKEN)

    @property
    def cache_dir(self) -> Path:
        return self.state_dir / "cache" / "adapters"

    @property
    def merges_dir(self) -> Path:
        """Merged adapters (merged_adapters, route merge variants), written by the front ends, read by the core."""
        return self.state_dir / "cache" / "merges"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    @property
    def triton_cache_dir(self) -> Path:
        """Compiled kernels, kept across restarts (the engine core uses it unless TRITON_CACHE_DIR is set)."""
        return self.state_dir / "cache" / "triton"


class LoraModule(tuple):
    """`(name, path)` of one `--lora-modules` entry; `base_model_name` is what vLLM's JSON form may add (the
    server refuses to start when it names another model)."""

    base_model_name: str | None

    def __new__(cls, name: str, path: str, base_model_name: str | None = None) -> LoraModule:
        module = super().__new__(cls, (name, path))
        module.base_model_name = base_model_name
        return module


def parse_lora_module(spec: str) -> LoraModule:
    """`NAME=PATH`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError naming the
    expected forms otherwise."""
    if spec.lstrip().startswith("{"):
        return _parse_json_module(spec)
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(
            f"--lora-modules expects NAME=PATH or a JSON object with name and path (got {spec!r})"
        )
    return LoraModule(name.strip(), path.strip())


def _parse_json_module(spec: str) -> LoraModule:
    try:
        fields = json.loads(spec)
    except ValueError:
        raise ValueError(f"--lora-modules: {spec!r} is not valid JSON") from None
    known = {"name", "path", "base_model_name"}
    if not isinstance(fields, dict) or not {"name", "path"} <= set(fields) or set(fields) - known:
        raise ValueError(
            f"--lora-modules JSON takes name, path and optionally base_model_name (got {spec!r})"
        )
    if not all(isinstance(v, str) and v for v in fields.values()):
        raise ValueError(f"--lora-modules JSON values must be non-empty strings (got {spec!r})")
    return LoraModule(fields["name"], fields["path"], fields.get("base_model_name"))
