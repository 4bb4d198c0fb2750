"""GET /health (the process and its engine are alive), /ready (able to serve), /metrics (Prometheus text,
for scrapers only).

/health and /ready need no key (probes) and read no store. /metrics is guarded by MetricsAccess.
"""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from loraserve.ops.metrics_access import MetricsAccess
from loraserve.ops.readiness import Readiness, ReadyStatus
from loraserve.services import Services


class Health(msgspec.Struct, frozen=True, kw_only=True):
    status: str = "ok"


class OpsController(Controller):
    tags = ["ops"]

    @get("/health", summary="The process answers; 503 once the engine has stopped")
    async def health(self, services: NamedDependency[Services]) -> Response[Health]:
        """200 while the process can serve; 503 once the engine has stopped, so a liveness probe restarts it."""
        dead = services.engine is not None and getattr(services.engine, "dead_error", None) is not None
        if dead:
            return Response(Health(status="engine stopped"), status_code=503)
        return Response(Health())

    @get("/ready", summary="Able to serve: model loaded, stores answering, not draining (else 503)")
    async def ready(
        self, services: NamedDependency[Services], readiness: NamedDependency[Readiness]
    ) -> Response[ReadyStatus]:
        status = await readiness.check(services)
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
