"""HTTP endpoints of A/B routes: `PUT/GET/DELETE /v1/routes/{name}` and `GET /v1/routes`."""

from __future__ import annotations

from litestar import Controller, Request, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.status_codes import HTTP_200_OK

from loraserve.openapi import BEARER_SECURITY
from loraserve.routes import service
from loraserve.routes.schemas import RouteDeleted, RouteList
from loraserve.routing import Route
from loraserve.services import Services
from loraserve.tenancy import Principal

ServicesDep = NamedDependency[Services]
PrincipalDep = NamedDependency[Principal]
# A route of MAX_VARIANTS variants is a few KiB; nothing legitimate comes near this.
MAX_ROUTE_BODY_BYTES = 64 * 1024


class RoutesController(Controller):
    path = "/v1/routes"
    tags = ["routes"]
    security = BEARER_SECURITY
    request_max_body_size = MAX_ROUTE_BODY_BYTES

    @put("/{name:str}", summary="Create or replace an A/B route")
    async def put_route(
        self, name: FromPath[str], request: Request, services: ServicesDep, principal: PrincipalDep
    ) -> Route:
        # The raw body goes to routing.parse_route, whose messages name the wrong field (422).
        return await service.put_route(services, principal, name, await request.body())

    @get(summary="The tenant's routes")
    async def list_routes(self, services: ServicesDep, principal: PrincipalDep) -> RouteList:
        return await service.list_routes(services, principal)

    @get("/{name:str}", summary="One route")
    async def get_route(self, name: FromPath[str], services: ServicesDep, principal: PrincipalDep) -> Route:
        return await service.get_route(services, principal, name)

    @delete("/{name:str}", status_code=HTTP_200_OK, summary="Delete a route")
    async def delete_route(
        self, name: FromPath[str], services: ServicesDep, principal: PrincipalDep
    ) -> RouteDeleted:
        return await service.delete_route(services, principal, name)
