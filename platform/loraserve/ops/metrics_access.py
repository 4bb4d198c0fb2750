"""Who may read /metrics: its labels name tenants, routes and adapters, so tenants must not.

The server listens on a second port for scrapers (`--metrics-port`, default `--port` + 1), which
answers only /metrics, /health and /ready. In Kubernetes the Service exposes the main port alone, so
tenants never reach the metrics port, while Prometheus and the Inference Gateway's endpoint picker
scrape pods directly. On the main port /metrics is 404 unless a scrape key is set
(`--metrics-key`): then a scraper sending `Authorization: Bearer KEY` may read it on either port,
and a scrape without the key gets 401.

The listener also serves the operator's residency endpoints (`/v1/residency...`, the placement loop's
admin API; ops/residency_controller.py) when a placement key is set (`--placement-key`): they need
`Authorization: Bearer PLACEMENT_KEY` and exist nowhere else (404 on the main port, and without a key).

A request's port is the listening socket's (ASGI `scope["server"]`), so no header can fake it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from litestar import Request
from litestar.exceptions import NotAuthorizedException, NotFoundException

# What the metrics listener answers; any other path there is 404 (no tenant API on the scrape port).
METRICS_PORT_PATHS = frozenset({"/metrics", "/health", "/ready"})
# The operator's residency endpoints: on the metrics listener only, with the placement key.
RESIDENCY_PATHS = frozenset({"/v1/residency", "/v1/residency/preload", "/v1/residency/unpin"})


@dataclass(frozen=True)
class MetricsAccess:
    port: int | None = None  # the metrics listener's port; None: no listener
    key: str | None = None  # the scrape key; None: none (then only the listener serves /metrics)
    placement_key: str | None = None  # the residency endpoints' key; None: those endpoints are off

    def on_metrics_port(self, request: Request) -> bool:
        server = request.scope.get("server")
        return self.port is not None and server is not None and server[1] == self.port

    def check_scrape(self, request: Request) -> None:
        """Raise 404 (main port, no key) or 401 (key missing or wrong) unless this scrape may read."""
        if self.key is None:
            if not self.on_metrics_port(request):
                raise NotFoundException()
            return
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key.encode()):
            raise NotAuthorizedException(
                "/metrics needs the scrape key: send 'Authorization: Bearer KEY' (--metrics-key)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_placement(self, request: Request) -> None:
        """Raise 404 (main port, or no placement key) or 401 (key missing or wrong) unless the caller is
        the operator on the metrics listener."""
        if self.placement_key is None or not self.on_metrics_port(request):
            raise NotFoundException()
        if not _bearer_matches(request, self.placement_key):
            raise NotAuthorizedException(
                "the residency endpoints need the placement key: send 'Authorization: Bearer KEY' "
                "(--placement-key)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_path(self, request: Request) -> None:
        """The metrics listener serves the ops paths only: tenants' API calls get 404 there."""
        # The matched handler's own paths, not the URL's: a --root-path prefix must not matter.
        allowed = METRICS_PORT_PATHS | RESIDENCY_PATHS
        if self.on_metrics_port(request) and not request.route_handler.paths <= allowed:
            raise NotFoundException()


def _bearer_matches(request: Request, key: str) -> bool:
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
