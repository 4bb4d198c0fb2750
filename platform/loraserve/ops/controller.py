"""GET /health (the process and its engine are alive), /ready (able to serve), /metrics (Prometheus text,
for scrapers only).

/health and /ready need no key (probes) and read no store. /metrics is guarded by MetricsAccess.
"""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, Response, get
from litestar.datastructures import State
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from loraserve.dependencies import SERVICES_KEY
from loraserve.ops.metrics_access import MetricsAccess
from loraserve.ops.readiness import Readiness, ReadyStatus, engine_dead_reason
from loraserve.services import Services


class Health(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    status: str  # "ok" or "unhealthy"
    reason: str | None = None  # why the server is not healthy


class OpsController(Controller):
    tags = ["ops"]

    @get("/health", summary="The process answers; 503 once the engine has stopped")
    async def health(self, state: State) -> Response[Health]:
        """200 while the process serves; 503 once the engine core died (a liveness probe restarts the pod)."""
        reason = engine_dead_reason(state.get(SERVICES_KEY))
        if reason is not None:
            return Response(Health(status="unhealthy", reason=reason), status_code=503)
        return Response(Health(status="ok"))

    @get("/ready", summary="Able to serve: model loaded, stores answering, not draining (else 503)")
    async def ready(self, state: State, readiness: NamedDependency[Readiness]) -> Response[ReadyStatus]:
        """503 with the step it is at while the model converts or loads (the server listens meanwhile)."""
        services = state.get(SERVICES_KEY)
        status = await readiness.check(services) if services is not None else readiness.not_loaded()
        return Response(status, status_code=200 if status.ready else 503)

    @get("/metrics", summary="Prometheus metrics (vLLM's names where they overlap)")
    async def metrics(
        self,
        request: Request,
        services: NamedDependency[Services],
        metrics_access: NamedDependency[MetricsAccess],
    ) -> Response[bytes]:
        metrics_access.check_scrape(request)
        body = services.metrics.render() if services.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)
