"""Build the server's long-lived parts from its settings, and close them again (the app's lifespan).

Order matters: the adapter store and config store are opened and checked before the model loads, so a
wrong URL or an unreadable keys file fails in a second rather than after a minute of loading weights.
The app runs this in the background while the server already listens: `progress` hears each slow step
(/ready reports it), and a cancelled start (SIGTERM while loading) still shuts down the engine it began.
The same code builds the one server process and each front-end process of several (`role`:
loraserve.frontends.role says what differs).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from adapter_format.names import format_adapter_id
from adapters_store import AdapterNotFound, AdapterStore, DiskCache, StoreConfig, open_store
from adapters_store.engine_source import StoreAdapterSource
from adapters_store.merged_source import MergedAdapterSource
from engine import AsyncLLM, EngineConfig, model_shape
from engine.generation_config import load_generation_defaults
from engine.model.loader import load_config, resolve_model_path
from loraserve.adapter_lookup import AdapterLookup
from loraserve.config_store import CachedConfigStore, open_config_store, redact_url
from loraserve.demo_model import DEMO_MODEL_NAME, demo_model_converted
from loraserve.frontends.role import SingleProcess
from loraserve.merges.service import Merges
from loraserve.name_conflicts import check_not_base_model
from loraserve.ops.metrics import Metrics
from loraserve.ops.server_load import ServerLoad
from loraserve.routing import Router
from loraserve.services import Services
from loraserve.settings import ServerSettings
from loraserve.tenancy import (
    DEFAULT_TENANT,
    Authenticator,
    ConcurrencyLimiter,
    TokenRateLimiter,
    load_api_keys,
)
from loraserve.tenancy.upload_slots import UploadSlots
from loraserve.work_pool import WorkPool

log = logging.getLogger("loraserve")


def store_config(settings: ServerSettings) -> StoreConfig:
    return StoreConfig(
        url=settings.adapter_store,
        max_lora_rank=settings.max_lora_rank,
        vocab_modules_served=settings.max_vocab_loras > 0,
        cache_dir=str(settings.cache_dir),
        served_model=announced_model_id(settings),
        cache_max_bytes=settings.adapter_cache_max_bytes,
        cache_min_free_bytes=settings.adapter_cache_min_free_bytes,
    )


def engine_config(settings: ServerSettings, model: str) -> EngineConfig:
    """The engine's config: the engine settings the server's settings embed (engine.engine_args), and the model."""
    return EngineConfig.from_args(settings, model)


def base_model_id(settings: ServerSettings, model: str) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return Path(model).name if settings.model is None else settings.model


def announced_model_id(settings: ServerSettings) -> str:
    """The base model's id before anything is loaded (the demo model's folder is named after it)."""
    return base_model_id(settings, settings.model or DEMO_MODEL_NAME)


def check_lora_modules(settings: ServerSettings, model: str, model_id: str) -> None:
    """`--lora-modules` must not take the base model's name nor name another base model."""
    for module in settings.lora_modules:
        check_not_base_model(module[0], model_id, "--lora-modules adapter")
        base = getattr(module, "base_model_name", None)
        if base is not None and base not in (model_id, settings.model, model):
            raise ValueError(
                f"--lora-modules {module[0]}: base_model_name {base!r} is not the served model {model_id!r}"
            )


@asynccontextmanager
async def open_services(
    settings: ServerSettings, progress: Callable[[str], None] = lambda step: None, role=None
) -> AsyncIterator[Services]:
    """Everything `Services` holds, built from `settings`; closed in reverse order on exit. `role`: a
    loraserve.frontends.role object (default: the one server process)."""
    role = role or SingleProcess(settings)
    if settings.model is None and not demo_model_converted(settings.models_dir):
        progress("converting the demo model (first start only; the server log shows its steps)")
    model = settings.model or str(await asyncio.to_thread(_demo_model, settings))
    progress("opening the adapter store and the config store")
    model_id = base_model_id(settings, model)
    check_lora_modules(settings, model, model_id)
    model_path = resolve_model_path(model)
    shape = model_shape(load_config(model_path))  # sizes and the architecture's LoRA targets
    sampling_defaults = load_generation_defaults(model_path, settings.generation_config)
    config = store_config(settings)
    store = open_store(config, shape)
    await asyncio.to_thread(store.check)
    if role.owns_store_upkeep:
        threading.Thread(target=sweep_quietly, args=(store,), name="adapter-store-sweep", daemon=True).start()
    disk_cache = DiskCache(
        store, config.cache_dir, config.cache_max_bytes, min_free_bytes=config.cache_min_free_bytes
    )
    config_store = CachedConfigStore(
        role.config_store(open_config_store(settings.config_store or str(settings.state_dir / "config")))
    )
    await config_store.start()
    engine: AsyncLLM | None = None
    work_pool = WorkPool(settings.tokenizer_pool_size)
    tenant_table = role.tenant_table()  # the concurrency, token and upload limiters' counters
    try:
        keys = load_api_keys(settings.api_keys) if settings.api_keys else []
        authenticator = await Authenticator.create(keys, config_store)
        adapter_lookup = AdapterLookup(ttl_s=settings.adapter_lookup_ttl)
        metrics = Metrics(
            model_id,
            lambda: engine.stats() if engine is not None else None,
            lambda: config_store.healthy,
            lambda: adapter_lookup.store_up,
            disk_cache.cached_versions,
            multiprocess_dir=role.metrics_dir,
        )
        log.info("loading model %s (%s) in the engine core process", model_id, model)
        progress("loading the model in the engine core process")
        # The source pickles into the core (a recipe: store, disk cache folder, shape); what it and the
        # core's adapter manager observe there comes back with the core's outputs to `metrics`.
        source = MergedAdapterSource(
            StoreAdapterSource(
                store, disk_cache, shape, settings.max_lora_rank, observer=metrics.adapter_event
            ),
            settings.merges_dir,
        )
        engine = await _start_engine(
            role,
            engine_config(settings, model),
            adapter_source=source,
            adapter_observer=metrics.adapter_event,
            triton_cache_dir=str(settings.triton_cache_dir),
        )
        if settings.lora_modules and role.owns_store_upkeep:
            progress("storing and preloading --lora-modules")
            stored = await asyncio.to_thread(preload_lora_modules, store, settings.lora_modules)
            engine.preload_adapters(stored)  # into the core's CPU tier now, not at the first request
        _log_startup(settings, model_id, model, authenticator.open_mode)
        yield Services(
            base_model_id=model_id,
            engine=engine,
            adapter_store=store,
            disk_cache=disk_cache,
            config_store=config_store,
            authenticator=authenticator,
            router=Router(on_pick=metrics.route_picked),
            limiter=ConcurrencyLimiter(settings.max_concurrent_requests_per_tenant, table=tenant_table),
            token_limiter=TokenRateLimiter(table=tenant_table),
            metrics=metrics,
            adapter_lookup=adapter_lookup,
            tokenizer=engine.tokenizer,
            allowed_lora_paths=settings.allowed_lora_paths,
            upload_slots=UploadSlots(settings.max_concurrent_uploads_per_tenant, table=tenant_table),
            max_routes_per_tenant=settings.max_routes_per_tenant,
            max_model_len=engine.max_model_len,
            sampling_defaults=sampling_defaults,
            max_logprobs=settings.max_logprobs,
            prompt_tokens_details=settings.enable_prompt_tokens_details,
            force_include_usage=settings.enable_force_include_usage,
            tokens_as_token_ids=settings.return_tokens_as_token_ids,
            server_load=ServerLoad() if settings.enable_server_load_tracking else None,
            tool_call_parser=settings.auto_tool_call_parser,
            work_pool=work_pool,
            front_ends=role.front_ends,
            merges=Merges(settings.merges_dir, shape, settings.max_lora_rank, model_id),
        )
    finally:
        work_pool.close()
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        await config_store.close()
        tenant_table.close()


async def _start_engine(role, config: EngineConfig, **options: object) -> AsyncLLM:
    """The role's engine (started, or joined), built in a thread. Cancelled (a SIGTERM during the load),
    it waits for the start and shuts the engine down before it re-raises, so no engine-core process or
    core connection outlives the server."""
    starting = asyncio.ensure_future(role.start_engine(config, **options))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        with suppress(Exception):
            engine = await starting
            await asyncio.to_thread(engine.shutdown)
        raise


def preload_lora_modules(store: AdapterStore, modules: tuple[tuple[str, str], ...]) -> list[str]:
    """Put `--lora-modules` into the default tenant's store, unless the latest version has the same bytes;
    returns the engine ids of the versions that serve them."""
    stored = []
    for name, path in modules:
        weights = Path(path) / "adapter_model.safetensors"
        digest = _sha256(weights) if weights.is_file() else None
        try:
            latest = store.get(DEFAULT_TENANT, name)
        except AdapterNotFound:
            latest = None
        if latest is not None and latest.sha256 == digest:
            log.info("adapter %s: %s is already stored as %s", name, path, latest.ref)
            record = latest
        else:
            record = store.put(DEFAULT_TENANT, name, path)
            log.info("adapter %s: stored %s as %s for tenant %r", name, path, record.ref, DEFAULT_TENANT)
        stored.append(format_adapter_id(DEFAULT_TENANT, record.name, record.version))
    return stored


def sweep_quietly(store: AdapterStore) -> None:
    """At start, in the background: remove uploads that died half-written (see AdapterStore.sweep)."""
    try:
        swept = store.sweep()
    except Exception as exc:  # the store may be down: serving does not depend on this
        log.warning("could not sweep the adapter store for dead uploads: %s", exc)
        return
    if swept:
        log.info("swept %d half-written or half-deleted adapter versions from the store", swept)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _demo_model(settings: ServerSettings) -> Path:
    from loraserve.demo_model import ensure_demo_model  # transformers' GGUF reader loads only when needed

    return ensure_demo_model(settings.models_dir)


def _log_startup(settings: ServerSettings, model_id: str, model: str, open_mode: bool) -> None:
    log.info("model: %s (from %s)", model_id, model)
    if settings.tool_call_parser and not settings.enable_auto_tool_choice:
        log.warning(
            'tool_choice "auto" is off: --tool-call-parser %s needs --enable-auto-tool-choice',
            settings.tool_call_parser,
        )
    log.info("adapter store: %s", settings.adapter_store)
    if settings.metrics_listen_port is None and settings.metrics_key is None:
        log.warning("no metrics listener and no --metrics-key: /metrics is not served")
    log.info(
        "config store: %s",
        redact_url(settings.config_store)
        if settings.config_store
        else f"embedded, under {settings.state_dir / 'config'}",
    )
    if open_mode:
        log.warning(
            "OPEN MODE: no API keys are configured, so every request runs as tenant %r with admin rights. "
            "Pass --api-keys FILE before exposing this server.",
            DEFAULT_TENANT,
        )
