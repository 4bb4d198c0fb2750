"""The Litestar app: `create_app(settings)` for the server, `create_app(settings, services=...)` for tests.

The lifespan owns the engine, the adapter store, the config store and the metrics registry (see
bootstrap.py) unless the caller passes its own `services`, which it then keeps owning. On the way out
it drains (ops/shutdown.py), so in-flight streams end cleanly whoever stops the server.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State

from loraserve.adapters import adapters_controller
from loraserve.adapters.runtime_loading import RuntimeLoRAController
from loraserve.bootstrap import open_services, store_config
from loraserve.dependencies import DEPENDENCIES, METRICS_ACCESS_KEY, READINESS_KEY, SERVICES_KEY
from loraserve.errors import EXCEPTION_HANDLERS
from loraserve.inference.controller import InferenceController, invocations
from loraserve.openapi import openapi_config
from loraserve.ops.controller import OpsController
from loraserve.ops.metrics_access import MetricsAccess
from loraserve.ops.readiness import Readiness
from loraserve.ops.shutdown import Shutdown
from loraserve.routes import RoutesController
from loraserve.services import Services
from loraserve.settings import ServerSettings
from loraserve.tokenization import TokenizationController
from loraserve.usage import UsageController

SHUTDOWN_KEY = "shutdown"
# Chat histories can be long; uploads have their own, larger limit (adapters_controller).
MAX_REQUEST_BODY_BYTES = 16 << 20


def create_app(settings: ServerSettings, *, services: Services | None = None, role=None) -> Litestar:
    """`role`: what this process is (loraserve.frontends.role; default: the one server process)."""
    shutdown = Shutdown(settings.shutdown_timeout)
    config = services.adapter_store.config if services is not None else store_config(settings)
    metrics_access = MetricsAccess(port=settings.metrics_listen_port, key=settings.metrics_key)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if services is not None:
            async with _serving(app, services, shutdown):
                yield
            return
        async with open_services(settings, role) as built, _serving(app, built, shutdown):
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
        ],
        dependencies=DEPENDENCIES,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        state=State({SHUTDOWN_KEY: shutdown, READINESS_KEY: Readiness(), METRICS_ACCESS_KEY: metrics_access}),
        before_request=metrics_access.check_path,
        request_max_body_size=MAX_REQUEST_BODY_BYTES,
        openapi_config=openapi_config(_version()),
    )


@asynccontextmanager
async def _serving(app: Litestar, services: Services, shutdown: Shutdown) -> AsyncIterator[None]:
    services.shutdown = shutdown
    # Uploads and deletes through any replica drop this replica's cached lookups of that adapter.
    unsubscribe = await services.config_store.subscribe(services.adapter_lookup.on_config_event)
    app.state[SERVICES_KEY] = services
    watch = getattr(services.engine, "add_death_callback", None)
    if watch is not None:  # the engine core died: streams already failed; stop the server (exit 1)
        watch(lambda error: shutdown.fail(str(error)))
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
