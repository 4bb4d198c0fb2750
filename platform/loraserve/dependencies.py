"""The app's dependencies: `services` (the lifespan's parts), `principal` (the caller), `readiness`,
`metrics_access` (who may scrape /metrics).

Handlers declare them by name (`services: NamedDependency[Services]`); `principal` authenticates the
`Authorization: Bearer KEY` header on every request that asks for it, so a handler that takes a
principal cannot be reached without a valid key (or open mode).
"""

from __future__ import annotations

import dataclasses

from litestar import Request
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide

from loraserve.errors import ServiceUnavailable
from loraserve.ops.metrics_access import MetricsAccess
from loraserve.ops.readiness import Readiness
from loraserve.ops.serving_warmup import WARMUP_PRINCIPAL, is_warmup
from loraserve.services import Services
from loraserve.tenancy import Principal, authorization_header

SERVICES_KEY = "services"
READINESS_KEY = "readiness"
METRICS_ACCESS_KEY = "metrics_access"


def provide_services(request: Request, state: State) -> Services:
    services = state.get(SERVICES_KEY)
    if services is None:  # the server listens while the model loads (/health and /ready answer)
        raise ServiceUnavailable(
            "the model is still loading; retry shortly (GET /ready says when)", code="model_not_ready"
        )
    if is_warmup(request.scope):  # the serving warm-up's own requests: not in the request metrics
        return dataclasses.replace(services, metrics=None)
    return services


async def provide_principal(request: Request, services: NamedDependency[Services]) -> Principal:
    if is_warmup(request.scope):  # set in process only (ops/serving_warmup.py), never by a client
        return WARMUP_PRINCIPAL
    return await services.authenticator.authenticate(authorization_header(request.headers))


def provide_readiness(state: State) -> Readiness:
    return state[READINESS_KEY]


def provide_metrics_access(state: State) -> MetricsAccess:
    return state[METRICS_ACCESS_KEY]


DEPENDENCIES = {
    "services": Provide(provide_services, sync_to_thread=False),
    "principal": Provide(provide_principal),
    "readiness": Provide(provide_readiness, sync_to_thread=False),
    "metrics_access": Provide(provide_metrics_access, sync_to_thread=False),
}
