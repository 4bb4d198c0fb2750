"""What the route endpoints do: validate, check every variant's adapter exists, store per tenant.

Routes live in the config store (Redis or embedded); writing one publishes a change event, so every
replica drops its cached copy within a second. A tenant's routes are keyed by its tenant, so another
tenant's route answers exactly like a missing one.

The checks and the write are one step with respect to adapter deletions and the tenant's other route
writes (ConfigStore.put_route_checked): a version deleted meanwhile is seen missing, or its deletion
sees the route and is refused; the quota (`--max-routes-per-tenant`) counts the routes as stored.
"""

from __future__ import annotations

from adapters_store import AdapterNotFound
from loraserve.config_store.errors import AdapterBeingDeleted
from loraserve.errors import BadRequest, Conflict, NotFound, PermissionDenied
from loraserve.merges.spec import check_merge
from loraserve.name_conflicts import check_not_base_model
from loraserve.resolution.resolve import resolve_merge
from loraserve.resolution.resolved import ModelNotFound
from loraserve.routes.schemas import RouteDeleted, RouteList
from loraserve.routing import AdapterRef, InvalidRoute, Route, check_route_adapters, parse_route
from loraserve.services import Services
from loraserve.tenancy import Principal, require_admin


class RouteNotFound(NotFound):
    code = "route_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"no route named {name!r}; create it with PUT /v1/routes/{name}")


class RouteQuotaExceeded(PermissionDenied):
    code = "route_quota_exceeded"


class AdapterBeingDeletedConflict(Conflict):
    code = "adapter_being_deleted"


async def put_route(services: Services, principal: Principal, name: str, body: bytes) -> Route:
    """Create or replace a route; InvalidRoute (422) for a bad body or a variant naming no adapter,
    RouteQuotaExceeded (403) for a new route past the tenant's quota."""
    require_admin(principal)
    route = parse_route(name, body)
    check_not_base_model(route.name, services.base_model_id, "route")
    store, tenant = services.adapter_store, principal.tenant
    await _check_merges(services, tenant, route)

    async def exists(ref: AdapterRef) -> bool:  # asks the store itself: no cached answer
        try:
            await services.adapter_lookup.call(store.get, tenant, ref.name, ref.version)
        except AdapterNotFound:
            return False
        return True

    async def check(names: list[str]) -> None:
        limit = services.max_routes_per_tenant
        if route.name not in names and len(names) >= limit:
            raise RouteQuotaExceeded(
                f"this tenant already has {len(names)} routes, its limit (--max-routes-per-tenant is {limit}); "
                "delete one (DELETE /v1/routes/{name}) or ask the operator for a higher limit",
                param="name",
            )
        await check_route_adapters(route, exists)

    try:
        await services.config_store.put_route_checked(tenant, route, check)
    except AdapterBeingDeleted as exc:
        raise AdapterBeingDeletedConflict(
            f"adapter {exc.name!r}, which this route names, is being deleted; retry the request"
        ) from None
    return route


async def _check_merges(services: Services, tenant: str, route: Route) -> None:
    """Merge each merge variant now (422 naming it if its parts are missing or cannot be merged), so a
    stored route never answers 400 to its users, and its first users find the merge done."""
    for index, variant in enumerate(route.variants):
        if variant.merge is None:
            continue
        at = f"variants[{index}].merge"
        try:
            await resolve_merge(services, tenant, check_merge(variant.merge, at), at=at, route=route.name)
        except (ModelNotFound, BadRequest) as exc:
            raise InvalidRoute(str(exc), field=exc.param or at) from None


async def list_routes(services: Services, principal: Principal) -> RouteList:
    return RouteList(data=await services.config_store.list_routes(principal.tenant))


async def get_route(services: Services, principal: Principal, name: str) -> Route:
    route = await services.config_store.get_route(principal.tenant, name)
    if route is None:
        raise RouteNotFound(name)
    return route


async def delete_route(services: Services, principal: Principal, name: str) -> RouteDeleted:
    require_admin(principal)
    if not await services.config_store.delete_route(principal.tenant, name):
        raise RouteNotFound(name)
    return RouteDeleted(name=name)
