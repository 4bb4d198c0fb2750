"""The A/B route API: `PUT/GET/DELETE /v1/routes/{name}` over the tenant's routes in the config store."""

from loraserve.routes.controller import RoutesController
from loraserve.routes.service import RouteNotFound

__all__ = ["RouteNotFound", "RoutesController"]
