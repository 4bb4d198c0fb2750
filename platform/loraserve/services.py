"""What the HTTP handlers share: the long-lived parts the app's lifespan builds and closes.

Handlers receive `services: Services` and `principal: Principal` as Litestar dependencies (the app
factory provides both); they stay two or three lines long and call the parts below.

Adapter ids handed to the engine are `tenant/name@version` (adapter_format/names.py: `format_adapter_id`):
the tenant is part of the id, so two tenants' adapters of the same name never share a GPU slot or a KV
prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters_store import AdapterStore, DiskCache
from engine.engine_args import EngineArgs
from loraserve.adapter_lookup import AdapterLookup
from loraserve.config_store import ConfigStore
from loraserve.merges.service import Merges
from loraserve.ops.server_load import ServerLoad
from loraserve.ops.shutdown import Shutdown
from loraserve.routing import Router
from loraserve.tenancy import Authenticator, ConcurrencyLimiter, TokenRateLimiter
from loraserve.tenancy.upload_slots import UploadSlots
from loraserve.work_pool import WorkPool


class EngineClient(Protocol):
    """The part of the engine the handlers use (engine.AsyncLLM fits)."""

    def generate(
        self,
        prompt: Any,
        params: Any,
        request_id: str,
        adapter: str | None = None,
        *,
        meta: Any = None,  # engine.RequestMeta: tenant, weight, priority, cache salt
    ) -> Any: ...

    async def abort(self, request_id: str) -> None: ...

    def forget_adapter(self, adapter_id: str) -> None:
        """An adapter version was deleted: no new requests; its slot frees when its last request ends."""

    def stats(self) -> Any:
        """The latest engine.EngineStats (`resident_adapters` tells resolution which need no store call)."""

    def preload_adapters(self, adapter_ids: list[str], level: str = "cpu", pin: bool = False) -> None:
        """Load adapters without a request, into the CPU tier or a GPU slot (`pin`: keep the slot)."""

    def unpin_adapters(self, adapter_ids: list[str], unload: bool = False) -> None:
        """Drop an operator's pins; `unload` frees the adapters' slots and CPU-tier rows too."""


class Tokenizer(Protocol):
    """The part of the base model's tokenizer the handlers use (transformers' tokenizers fit)."""

    chat_template: str | None

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any: ...  # `.input_ids`: list[int]

    def __len__(self) -> int: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


class RequestMetrics(Protocol):
    """What the handlers record and export (loraserve.ops.metrics.Metrics fits)."""

    def observe_request(
        self,
        *,
        ttft: float,
        tpot: float | None,
        e2e: float,
        inter_token: list[float] = (),
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
        times: list[Any] = (),  # engine.outputs.RequestTimes, one per finished completion
        n: int = 1,
        max_tokens: int | None = None,  # as the request ran: asked for, or the room the context left
    ) -> None: ...

    def count_finished(self, finish_reasons: list[str]) -> None:
        """vllm:request_success_total: completions that ended (stop, length, abort, error), once each."""

    def adapter_request(self, adapter_id: str) -> None:
        """A request resolved to this engine adapter id (counted per adapter for the placement loop)."""

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""


# Services' annotations stay resolvable at run time (Litestar's msgspec checks the dependency's type),
# hence Protocols here rather than imports of Metrics (which imports this module) or of transformers.
@dataclass
class Services:
    base_model_id: str  # the `model` name of the base model in requests and /v1/models
    engine: EngineClient | None  # None until the model is loaded (then /ready says 503)
    adapter_store: AdapterStore
    disk_cache: DiskCache  # local copies of store files in front of the engine's loads
    config_store: ConfigStore  # routes and API keys (a CachedConfigStore in the server)
    authenticator: Authenticator
    router: Router
    limiter: ConcurrencyLimiter
    metrics: RequestMetrics | None = None  # the Prometheus registry; None in tests that do not need it
    # Per-tenant tokens per minute (keys' max_tokens_per_minute); one per replica, like `limiter`.
    token_limiter: TokenRateLimiter = field(default_factory=TokenRateLimiter)
    # Adapter-name lookups for model resolution, cached (see adapter_lookup.py); adapter events invalidate.
    adapter_lookup: AdapterLookup = field(default_factory=AdapterLookup)
    # The base model's Hugging Face tokenizer (prompts, chat templates, logprob tokens); None: token ids only.
    tokenizer: Tokenizer | None = None
    max_model_len: int | None = None  # prompt plus output tokens per sequence; None: not checked here
    # The model's recommended sampling fields for those a request leaves unset (its generation_config.json).
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's --max-logprobs: the most top logprobs a request may ask for; -1: the whole vocabulary.
    max_logprobs: int = EngineArgs.max_logprobs
    # vLLM's --enable-prompt-tokens-details, --enable-force-include-usage, --enable-server-load-tracking
    prompt_tokens_details: bool = False
    force_include_usage: bool = False
    tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: for every request
    server_load: ServerLoad | None = None  # None: load tracking off (GET /load is 404)
    # Per-tenant cap on adapter uploads at once (--max-concurrent-uploads-per-tenant): 429 beyond it.
    upload_slots: UploadSlots = field(default_factory=UploadSlots)
    max_routes_per_tenant: int = 1000  # --max-routes-per-tenant: creating a route past it is 403
    # Folders POST /v1/load_lora_adapter may read from (--allowed-lora-paths); empty: runtime loading off.
    allowed_lora_paths: tuple[str, ...] = ()
    # The parser tool_choice "auto" uses (--tool-call-parser with --enable-auto-tool-choice; None: "auto" is
    # a 400, except for adapters uploaded with a parser of their own).
    tool_call_parser: str | None = None
    # Merged adapters (a request's merged_adapters, a route's merge variants); None: refused with a 400.
    merges: Merges | None = None
    # Built on the first structured-output request (loraserve.inference.structured): checks specs for 400s.
    grammar_compiler: Any = None
    # Threads for tokenizing, chat templates and spec checks, off the event loop (--tokenizer-pool-size).
    work_pool: WorkPool = field(default_factory=WorkPool)
    # Set by the app: SIGTERM's drain state; None means never draining.
    shutdown: Shutdown | None = None
    # One front-end process of several (--api-server-count): all of them, for /ready
    # (loraserve.frontends.role.FrontEnds); None for the one server process.
    front_ends: Any = None
