"""Turn a request's `model` into the base model, one adapter version, or an A/B route's pick.

Order: the base model id; then, for a plain name, the tenant's route of that name; then the tenant's
adapter (`name` is its latest version, `name@version` that one). Any of these may be written
tenant-qualified, `your-tenant/name`, the form cluster routers match adapters by (docs/OPERATIONS.md);
another tenant's prefix is a 404, as for a name that does not exist. Routes come before adapters so a
route can take over an adapter's name, e.g. route `support` = 90% `support@1` + 10% `support@2`,
and clients already sending `model: support` join the experiment without a change.
"""

from __future__ import annotations

from collections.abc import Callable

from adapters_store import AdapterNotFound, AdapterRecord
from adapters_store import InvalidName as StoreInvalidName
from loraserve.resolution.resolved import ModelNotFound, ResolvedModel
from loraserve.services import Services, engine_adapter_id
from loraserve.tenancy import Principal


async def resolve_model(
    services: Services, principal: Principal, model: str, user: str | None
) -> ResolvedModel:
    """ModelNotFound (404) for anything the tenant does not have; `user` keys sticky route picks."""
    tenant = principal.tenant
    if model == services.base_model_id:
        return ResolvedModel(kind="base", engine_adapter_id=None, served_model=model)
    asked, model = model, _unqualified(model, tenant)
    if model is None:
        raise _not_found(services, asked)
    if "@" not in model:
        route = await services.config_store.get_route(tenant, model)
        if route is not None:
            variant = services.router.pick(tenant, route, user)
            try:
                record = await _lookup(services, tenant, variant.adapter)
            except LookupError:
                raise ModelNotFound(
                    f"route {model!r} picked adapter {variant.adapter!r}, which no longer exists; "
                    f"point the route at existing adapters (PUT /v1/routes/{model})"
                ) from None
            return _adapter(tenant, record, route=route.name, variant=variant.adapter)
    try:
        record = await _lookup(services, tenant, model)
    except LookupError:
        raise _not_found(services, asked) from None
    return _adapter(tenant, record)


def _unqualified(model: str, tenant: str) -> str | None:
    """`model` without the caller's own `tenant/` prefix; None for another tenant's prefix."""
    prefix, slash, rest = model.partition("/")
    if not slash:
        return model
    return rest if prefix == tenant and rest else None


def _not_found(services: Services, model: str) -> ModelNotFound:
    return ModelNotFound(
        f"the model {model!r} does not exist; use {services.base_model_id!r}, one of your adapters "
        "(name or name@version) or one of your routes (GET /v1/models lists them)"
    )


async def model_exists(services: Services, principal: Principal, model: str) -> bool:
    """Whether `model` names the base model or one of the tenant's routes or adapters (no route pick)."""
    if model == services.base_model_id:
        return True
    model = _unqualified(model, principal.tenant)
    if model is None:
        return False
    if "@" not in model and await services.config_store.get_route(principal.tenant, model) is not None:
        return True
    try:
        await _lookup(services, principal.tenant, model)
    except LookupError:
        return False
    return True


async def _lookup(services: Services, tenant: str, ref: str) -> AdapterRecord:
    """The adapter record, or LookupError for a missing adapter or a name no adapter can have.

    StoreUnavailable (503) only for an adapter the lookup cache has never seen while the store fails:
    a resident adapter is served from the cache without a store call.
    """
    try:
        return await services.adapter_lookup.resolve(
            services.adapter_store, tenant, ref, is_resident=_is_resident(services)
        )
    except (AdapterNotFound, StoreInvalidName) as exc:
        raise LookupError(ref) from exc


def _is_resident(services: Services) -> Callable[[str, AdapterRecord], bool]:
    """Whether the engine holds a version in a GPU slot or its CPU tier (its latest published stats)."""

    def is_resident(tenant: str, record: AdapterRecord) -> bool:
        stats = getattr(services.engine, "stats", None)  # None: no engine yet
        resident = getattr(stats(), "resident_adapters", ()) if stats is not None else ()
        return engine_adapter_id(tenant, record.name, record.version) in resident

    return is_resident


def _adapter(
    tenant: str, record: AdapterRecord, *, route: str | None = None, variant: str | None = None
) -> ResolvedModel:
    return ResolvedModel(
        kind="route" if route else "adapter",
        engine_adapter_id=engine_adapter_id(tenant, record.name, record.version),
        served_model=record.ref,
        route=route,
        variant=variant,
        tool_call_parser=record.tool_call_parser,
    )
