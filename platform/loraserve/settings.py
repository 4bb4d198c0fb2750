"""The server's one validated configuration: every `loraserve serve` flag (vLLM's names where they exist).

Each field is declared once, with its default, its flag and help (`engine.engine_args.setting`); the
engine's settings are `engine.engine_args.EngineArgs`'s fields, embedded here, and `loraserve.cli` derives
the flags, the LORASERVE_* variables and `--help` from the fields of `ServerSettings`. The checks run
here, so a typo fails at start with a message naming the flag instead of deep inside the lifespan.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from adapter_format.names import NAME_RULE, is_valid_name
from adapters_store.config import DEFAULT_URL as DEFAULT_ADAPTER_STORE
from adapters_store.config import GiB, parse_store_url
from engine.core.steady import parse_cpus
from engine.engine_args import EngineArgs, Flag, flag_name, setting
from loraserve.flag_values import parse_lora_module, parse_size_flag
from loraserve.inference.tools.parsers import PARSERS, unknown_parser_message
from loraserve.ops.http_timeouts import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
)

DEFAULT_STATE_DIR = Path(".loraserve")
METRICS_OFF = 0  # --metrics-port off
# The default body limit: about 4 characters a token, JSON escapes (up to 6 bytes a character) and chat
# framing around them; 32 bytes a token of a 128k context is 4 MiB.
BODY_BYTES_PER_TOKEN = 32
DEFAULT_BODY_CONTEXT = 131072
MIN_DEFAULT_BODY_SIZE = 4 << 20
MIN_REQUEST_BODY_SIZE = 4096


def _metrics_port(raw: str) -> int:
    if raw.strip().lower() in ("off", "none", "0"):
        return METRICS_OFF
    port = int(raw)
    if not 1 <= port <= 65535:
        raise ValueError("expected a port in 1..65535, or off")
    return port


@dataclass(frozen=True)
class ServerSettings(EngineArgs):
    """Everything `loraserve serve` can be told (the engine's settings included); `create_app` reads only
    what it needs. Fields with a Flag are flags, in this order after the engine's in `--help`."""

    # None: the bundled demo model, converted once under ./.loraserve/models (see demo_model.py).
    model: str | None = setting(
        None,
        flag=Flag(
            "local folder or Hugging Face id of a supported model: Llama, Mistral, Qwen2/3, Gemma 2/3, "
            "Phi-3/4 (docs/MODELS.md; default: the bundled demo, "
            "SmolLM2-135M-Instruct, converted once under STATE_DIR/models)"
        ),
    )
    # The base model's id in requests; None: derived from `model`.
    served_model_name: str | None = setting(
        None, flag=Flag("the base model's name in requests and /v1/models (default: --model)")
    )
    host: str = setting("127.0.0.1", flag=Flag("address to listen on (default %(default)s; 0.0.0.0 for all)"))
    port: int = setting(8000, flag=Flag())
    # The prefix a path-routing proxy strips ("" when served at the root).
    root_path: str = setting(
        "",
        flag=Flag(
            "path prefix a proxy strips before forwarding (e.g. /llm), as vLLM's --root-path; "
            "links in the API schema carry it"
        ),
    )
    # vLLM's usage flags: usage.prompt_tokens_details (cached_tokens) in answers; usage in every stream
    # chunk and a usage chunk at the end of every stream, whatever stream_options says
    enable_prompt_tokens_details: bool = setting(
        False,
        flag=Flag(
            "answer usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache); "
            "off: null, as vLLM's flag",
            action="store_true",
        ),
    )
    enable_force_include_usage: bool = setting(
        False,
        flag=Flag(
            "usage in every streamed chunk and a usage chunk at the end of every stream, whatever "
            "stream_options asks (vLLM's flag)",
            action="store_true",
        ),
    )
    # vLLM's: GET /load answers the requests in flight
    enable_server_load_tracking: bool = setting(
        False,
        flag=Flag(
            'GET /load answers {"server_load": N}, the completions and chat requests in flight (vLLM\'s flag)',
            action="store_true",
        ),
    )
    # vLLM's: every request's logprobs name tokens token_id:N
    return_tokens_as_token_ids: bool = setting(
        False,
        flag=Flag(
            "logprobs name every token as token_id:N, as each request's return_tokens_as_token_ids does "
            "(vLLM's flag)",
            action="store_true",
        ),
    )
    # (name, local PEFT folder) pairs put into the default tenant's store at start.
    lora_modules: tuple[tuple[str, str], ...] = setting(
        (),
        flag=Flag(
            "PEFT folders stored as the default tenant's adapters at start (skipped if unchanged)",
            metavar="NAME=PATH",
            parse=parse_lora_module,
            nargs="+",
        ),
    )
    # Folders under which POST /v1/load_lora_adapter may read adapters; empty: runtime loading is off.
    allowed_lora_paths: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "folders POST /v1/load_lora_adapter may load adapters from (vLLM's runtime loading); "
            "unset: runtime loading is off",
            metavar="DIR",
            nargs="+",
        ),
    )
    adapter_store: str = setting(
        DEFAULT_ADAPTER_STORE, flag=Flag("file:///dir, file://./dir or s3://bucket/prefix")
    )
    # The local disk cache of adapter files: its byte budget, and the free space to keep on its disk
    # (entries are evicted to keep it, and to make room when the disk is full).
    adapter_cache_max_bytes: int = setting(
        10 * GiB,
        flag=Flag(
            "most bytes of adapter files kept in the local disk cache (STATE_DIR/cache/adapters), e.g. 10GiB "
            "or 500MiB; least recently used versions are evicted beyond it (default 10GiB)",
            metavar="SIZE",
            parse=parse_size_flag,
        ),
    )
    adapter_cache_min_free_bytes: int = setting(
        0,
        flag=Flag(
            "free space the adapter cache leaves on its disk: cached versions are evicted to keep it, as they "
            "are whenever the disk is full (default %(default)s: evict only when a write finds the disk full)",
            metavar="SIZE",
            parse=parse_size_flag,
        ),
    )
    # Adapter uploads one tenant may run at once (429 beyond), and A/B routes one tenant may hold (403 beyond).
    max_concurrent_uploads_per_tenant: int = setting(
        2, flag=Flag("adapter uploads one tenant may run at once; more get 429 (default %(default)s)")
    )
    max_routes_per_tenant: int = setting(
        1000, flag=Flag("A/B routes one tenant may hold; creating more gets 403 (default %(default)s)")
    )
    # None: embedded under ./.loraserve/config
    config_store: str | None = setting(
        None, flag=Flag("redis://host:6379/0 (default: embedded, under STATE_DIR/config)")
    )
    # JSON or YAML file of key -> {tenant, role}
    api_keys: str | None = setting(
        None,
        flag=Flag(
            "JSON or YAML file: key -> {tenant, role: admin|user, max_concurrent_requests, weight, "
            "max_tokens_per_minute, cache_group}"
        ),
    )
    shutdown_timeout: float = setting(30.0, flag=Flag("seconds in-flight requests get after SIGTERM"))
    # None: no default cap (keys may set their own)
    max_concurrent_requests_per_tenant: int | None = setting(
        None, flag=Flag("default per-tenant cap (keys may set their own)")
    )
    # The demo model, the embedded config, the disk cache, compiled kernels.
    state_dir: Path = setting(
        DEFAULT_STATE_DIR,
        flag=Flag("demo model, embedded config, adapter cache, compiled kernels (Triton cache)"),
    )
    # /metrics lives on a listener of its own, out of tenants' reach (docs/OPERATIONS.md, "Metrics").
    # None: --port + 1 (no listener when --port is 0 or 65535); METRICS_OFF: no listener.
    metrics_port: int | None = setting(
        None,
        flag=Flag(
            "port of the metrics listener, which serves only /metrics, /health and /ready, out of "
            "tenants' reach (default: --port + 1); off: none",
            parse=_metrics_port,
        ),
    )
    metrics_host: str | None = setting(None, flag=Flag("address of the metrics listener (default: --host)"))
    # Scrapers send `Authorization: Bearer KEY` on /metrics; with a key the main port serves /metrics too.
    metrics_key: str | None = setting(  # a secret: never in logs
        None,
        secret=True,
        flag=Flag(
            "scrapers must send 'Authorization: Bearer KEY' for /metrics; with a key the main port "
            "serves /metrics too (prefer the environment variable LORASERVE_METRICS_KEY)"
        ),
    )
    # The operator's residency endpoints (/v1/residency..., for `loraserve placement`) on the metrics
    # listener need `Authorization: Bearer KEY`; None: they are off.
    placement_key: str | None = setting(
        None,
        secret=True,
        flag=Flag(
            "turns on the residency endpoints (/v1/residency: preload, pin, unpin adapters) on the "
            "metrics listener, for `loraserve placement`; callers send 'Authorization: Bearer KEY' "
            "(prefer the environment variable LORASERVE_PLACEMENT_KEY)"
        ),
    )
    # Adapter lookups (name -> version) are checked against the store again after this many seconds;
    # uploads and deletes reach every replica at once as config events, so this only bounds a lost event.
    adapter_lookup_ttl: float = setting(
        30.0,
        flag=Flag(
            "seconds an adapter name's resolved version is trusted before the store is asked again "
            "(uploads and deletes reach every replica at once through the config store's events)"
        ),
    )
    # vLLM's: tool_choice "auto" parses calls in the output with this parser (inference/tools/parsers/);
    # adapters uploaded with a tool_call_parser of their own use theirs, with or without these flags.
    enable_auto_tool_choice: bool = setting(
        False,
        flag=Flag(
            'vLLM\'s: tool_choice "auto" (the default when a request has tools) reads tool calls from the '
            "output with --tool-call-parser (adapters uploaded with a tool_call_parser use their own)"
        ),
    )
    tool_call_parser: str | None = setting(
        None,
        flag=Flag(
            f"the format models write tool calls in, by vLLM's names: {', '.join(PARSERS)} "
            '(docs/API.md, "Tool calling")'
        ),
    )
    # Threads for tokenizing, chat templates and spec checks, off the event loop (loraserve/work_pool.py).
    tokenizer_pool_size: int = setting(
        2,
        flag=Flag(
            "threads that tokenize prompts, render chat templates and check structured-output specs, "
            "off the event loop (default %(default)s)"
        ),
    )
    # Largest JSON request body in bytes, refused with 413 before it is parsed; None: request_body_limit's
    # default for the context length. Uploads have their own limit (the store's).
    max_request_body_size: int | None = setting(
        None,
        flag=Flag(
            f"largest JSON request body, refused with 413 before it is parsed (default: {BODY_BYTES_PER_TOKEN} "
            f"bytes per token of --max-model-len, at least {MIN_DEFAULT_BODY_SIZE >> 20} MiB; uploads have "
            "their own limit)",
            metavar="BYTES",
        ),
    )
    # Slow clients (ops/http_timeouts.py): seconds for a request's headers, seconds for its body plus one
    # more for every `http_body_min_rate` bytes that arrive.
    http_header_timeout: float = setting(
        DEFAULT_HEADER_TIMEOUT_S,
        flag=Flag(
            "seconds a request's headers may take to arrive, from its first byte (slow clients get 408)"
        ),
    )
    http_body_timeout: float = setting(
        DEFAULT_BODY_TIMEOUT_S,
        flag=Flag(
            "seconds a request's body may take, plus one more for every --http-body-min-rate bytes "
            "received (slow clients get 408)"
        ),
    )
    http_body_min_rate: int = setting(
        DEFAULT_BODY_MIN_RATE,
        flag=Flag(
            "the body rate that extends --http-body-timeout (default %(default)s: a large upload at a steady "
            "rate always finishes, a trickle does not)",
            metavar="BYTES_PER_S",
        ),
    )
    # vLLM's --api-server-count: front-end (HTTP) processes behind the one port, each with its own
    # connection to the one engine core (docs/PROCESSES.md); None: from the host's cores
    # (loraserve.frontends.placement.default_api_server_count).
    api_server_count: int | None = setting(
        None,
        flag=Flag(
            "front-end (HTTP) processes behind the one port, each talking to the one engine core (vLLM's "
            "flag); default: 1 on the CPU, else (cores - 4) / 3 between 1 and 4 (docs/OPERATIONS.md)"
        ),
    )
    # Where the engine core's busy loop runs (engine.core.steady): auto, off, or a CPU list whose first
    # CPU runs the loop and the rest its other threads.
    engine_core_cpus: str = setting(
        "auto",
        flag=Flag(
            "CPUs of the engine core's busy loop: auto (on CUDA hosts of 4+ cores, the last CPU for the "
            "loop and, from 8 cores, the one before for its other threads), off, or a list such as 14,15 "
            "(the loop on the first, its other threads on the rest); everything else runs elsewhere"
        ),
    )
    # Before /ready: a few requests through each server process's own request path
    # (loraserve.ops.serving_warmup), bounded by the timeout; off with --no-serving-warmup.
    serving_warmup: bool = setting(
        True,
        flag=Flag(
            "before /ready, send each server process's own request path a few small requests "
            "(completions and chat, streamed and not; tenant _warmup, not in the request metrics), so the "
            "first requests after /ready are not the slow ones (docs/OPERATIONS.md)"
        ),
    )
    serving_warmup_timeout: float = setting(
        60.0,
        flag=Flag(
            "a serving warm-up not done after this is logged as a warning, and the server turns ready",
            metavar="SECONDS",
        ),
    )

    def label(self, name: str) -> str:
        """Errors name the flag (`--max-loras`), or the field of a setting that has none."""
        f = _FIELDS[name]
        return flag_name(f) if f.metadata.get("flag") is not None else name

    def not_a_choice(self, name: str, value: object, choices: tuple) -> str:
        allowed = ", ".join(choice for choice in choices if choice is not None)
        return f"{self.label(name)} {value!r} is not supported; use one of {allowed}"

    def __post_init__(self) -> None:
        super().__post_init__()  # the engine's settings (engine.engine_args.check_engine_args)
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


_FIELDS = {f.name: f for f in fields(ServerSettings)}
