"""The Litestar app: `create_app(settings)` for the server, `create_app(settings, services=...)` for tests.

The lifespan owns the engine, the adapter store, the config store and the metrics registry (see
bootstrap.py) unless the caller passes its own `services`, which it then keeps owning. It builds them
in the background, so the server listens from its first second: /health answers 200 and /ready 503
(naming the step: converting the demo model, loading it) until the model is loaded, and other requests
get 503 `model_not_ready`; a start that fails stops the server with exit code 1. On the way out it
drains (ops/shutdown.py), so in-flight streams end cleanly whoever stops the server.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State

from loraserve.adapters import adapters_controller
from loraserve.adapters.runtime_loading import RuntimeLoRAController
from loraserve.bootstrap import announced_model_id, open_services, store_config
from loraserve.dependencies import DEPENDENCIES, METRICS_ACCESS_KEY, READINESS_KEY, SERVICES_KEY
from loraserve.errors import EXCEPTION_HANDLERS
from loraserve.inference.controller import InferenceController, invocations
from loraserve.openapi import openapi_config
from loraserve.ops.controller import OpsController
from loraserve.ops.drain_guard import drain_guard
from loraserve.ops.metrics_access import MetricsAccess
from loraserve.ops.readiness import Readiness
from loraserve.ops.residency_controller import ResidencyController
from loraserve.ops.serving_warmup import warm_up
from loraserve.ops.shutdown import Shutdown
from loraserve.routes import RoutesController
from loraserve.services import Services
from loraserve.settings import ServerSettings
from loraserve.tokenization import TokenizationController
from loraserve.usage import UsageController

log = logging.getLogger("loraserve")

SHUTDOWN_KEY = "shutdown"


def create_app(settings: ServerSettings, *, services: Services | None = None, role=None) -> Litestar:
    """`role`: what this process is (loraserve.frontends.role; default: the one server process)."""
    shutdown = Shutdown(settings.shutdown_timeout)
    config = services.adapter_store.config if services is not None else store_config(settings)
    metrics_access = MetricsAccess(
        port=settings.metrics_listen_port, key=settings.metrics_key, placement_key=settings.placement_key
    )
    readiness = Readiness(
        model=services.base_model_id if services is not None else announced_model_id(settings)
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if services is not None:
            async with _serving(app, services, shutdown):
                yield
            return
        async with _loading_in_background(app, settings, shutdown, readiness, role):
            yield

    return Litestar(
        route_handlers=[
            InferenceController,
            invocations,
            TokenizationController,
            adapters_controller(config),
            RuntimeLoRAController,
            RoutesController,
            UsageController,
            OpsController,
            ResidencyController,
        ],
        dependencies=DEPENDENCIES,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        state=State({SHUTDOWN_KEY: shutdown, READINESS_KEY: readiness, METRICS_ACCESS_KEY: metrics_access}),
        before_request=metrics_access.check_path,
        middleware=[drain_guard(shutdown)],
        # JSON bodies; uploads have their own, larger limit (adapters_controller)
        request_max_body_size=settings.request_body_limit,
        openapi_config=openapi_config(_version()),
    )


@asynccontextmanager
async def _loading_in_background(
    app: Litestar, settings: ServerSettings, shutdown: Shutdown, readiness: Readiness, role=None
) -> AsyncIterator[None]:
    """Build the services in a task while the server answers; close whatever it built on the way out."""
    parts = AsyncExitStack()

    async def load() -> None:
        try:
            built = await parts.enter_async_context(open_services(settings, readiness.loading, role=role))
            warm = _serving_warmup(app, settings, readiness, built) if settings.serving_warmup else None
            await parts.enter_async_context(_serving(app, built, shutdown, warm))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server cannot serve: say why, then stop (exit code 1)
            log.exception("start-up failed")
            readiness.loading("start-up failed; the server is stopping (its log says why)")
            shutdown.fail(f"start-up failed: {exc}")
        else:
            log.info("ready: serving %s (/ready answers 200)", built.base_model_id)

    log.info("loading %s in the background: /health answers now, /ready once it is loaded", readiness.model)
    loading = asyncio.create_task(load(), name="load-services")
    try:
        yield
    finally:
        loading.cancel()  # a stop while loading (done: no effect)
        await asyncio.gather(loading, return_exceptions=True)
        await parts.aclose()


def _serving_warmup(app: Litestar, settings: ServerSettings, readiness: Readiness, services: Services):
    """The warm-up through this process's request path (ops/serving_warmup.py); /ready names it."""

    async def run() -> None:
        readiness.warming_up = True
        try:
            chat = bool(getattr(services.tokenizer, "chat_template", None))
            front_ends = services.front_ends
            name = "the server" if front_ends is None else f"front-end process {front_ends.slot}"
            await warm_up(app, services.base_model_id, chat, settings.serving_warmup_timeout, name)
        finally:
            readiness.warming_up = False

    return run


@asynccontextmanager
async def _serving(
    app: Litestar, services: Services, shutdown: Shutdown, warm: Callable[[], Awaitable[None]] | None = None
) -> AsyncIterator[None]:
    """`warm`: run once the app serves (requests reach the handlers), before this process is ready."""
    services.shutdown = shutdown
    # Uploads and deletes through any replica drop this replica's cached lookups of that adapter.
    unsubscribe = await services.config_store.subscribe(services.adapter_lookup.on_config_event)
    app.state[SERVICES_KEY] = services
    watch = getattr(services.engine, "add_death_callback", None)
    if watch is not None:  # the engine core died: streams already failed; stop the server (exit 1)
        watch(lambda error: shutdown.fail(str(error)))
    if warm is not None:
        await warm()
    if services.front_ends is not None:  # one front-end process of several: the others' /ready see it
        services.front_ends.mark_ready()
    try:
        yield
    finally:
        if services.front_ends is not None:
            services.front_ends.mark_stopping()
        if shutdown.num_in_flight:
            await shutdown.drain()
        app.state[SERVICES_KEY] = None
        unsubscribe()
        services.adapter_lookup.close()
        app.state[READINESS_KEY].close()


def _version() -> str:
    try:
        return importlib.metadata.version("loraserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing it
        return "0+unknown"


def shutdown_of(app: Litestar) -> Shutdown:
    """The app's drain state (the CLI starts the drain on SIGTERM)."""
    return app.state[SHUTDOWN_KEY]
