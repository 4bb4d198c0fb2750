"""Turn a request's `model` into the base model, one adapter version, or an A/B route's pick.

Order: the base model id; then, for a plain name, the tenant's route of that name; then the tenant's
adapter (`name` is its latest version, `name@version` that one). Any of these may be written
tenant-qualified, `your-tenant/name`, the form cluster routers match adapters by (docs/OPERATIONS.md);
another tenant's prefix is a 404, as for a name that does not exist. Routes come before adapters so a
route can take over an adapter's name, e.g. route `support` = 90% `support@1` + 10% `support@2`,
and clients already sending `model: support` join the experiment without a change.

A request's `merged_adapters` (with `model` the base model) and a route variant's `merge` resolve each
part like an adapter of the tenant (another tenant's looks missing), then to the merge of those versions,
computed once and kept as an adapter of its own (loraserve/merges/).
"""

from __future__ import annotations

from collections.abc import Callable

from adapter_format.errors import InvalidName
from adapter_format.merge import MergeError
from adapter_format.names import format_adapter_id, split_tenant
from adapters_store import AdapterNotFound, AdapterRecord
from loraserve.errors import BadRequest
from loraserve.merges.fields import MergedAdapters
from loraserve.merges.spec import InvalidMerge, MergeSpec, check_merge
from loraserve.resolution.resolved import ModelNotFound, ResolvedModel
from loraserve.services import Services
from loraserve.tenancy import Principal


async def resolve_model(
    services: Services,
    principal: Principal,
    model: str,
    user: str | None,
    merged: MergedAdapters | None = None,
) -> ResolvedModel:
    """ModelNotFound (404) for anything the tenant does not have; `user` keys sticky route picks;
    `merged` (the request's merged_adapters) needs `model` to be the base model."""
    tenant = principal.tenant
    if merged is not None:
        if model != services.base_model_id:
            raise BadRequest(
                f"merged_adapters merges adapters of the base model: set model to {services.base_model_id!r} "
                f"(got {model!r})",
                code="invalid_merge",
                param="model",
            )
        try:
            spec = check_merge(merged)
        except InvalidMerge as exc:
            raise BadRequest(str(exc), code="invalid_merge", param=exc.field) from None
        return await resolve_merge(services, tenant, spec)
    if model == services.base_model_id:
        return ResolvedModel(kind="base", engine_adapter_id=None, served_model=model)
    asked, model = model, _unqualified(model, tenant)
    if model is None:
        raise _not_found(services, asked)
    if "@" not in model:
        route = await services.config_store.get_route(tenant, model)
        if route is not None:
            variant = services.router.pick(tenant, route, user)
            if variant.merge is not None:
                spec = check_merge(variant.merge, "merge")  # checked when the route was stored
                return await resolve_merge(
                    services, tenant, spec, at="merge", route=route.name, variant=variant.label
                )
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
    prefix, rest = split_tenant(model)
    if prefix is None:
        return model
    return rest if prefix == tenant and rest else None


def _not_found(services: Services, model: str) -> ModelNotFound:
    return ModelNotFound(
        f"the model {model!r} does not exist; use {services.base_model_id!r}, one of your adapters "
        "(name or name@version) or one of your routes (GET /v1/models lists them)"
    )


async def resolve_merge(
    services: Services,
    tenant: str,
    spec: MergeSpec,
    *,
    at: str = "merged_adapters",
    route: str | None = None,
    variant: str | None = None,
) -> ResolvedModel:
    """The merge of the tenant's adapters `spec` names: 404 for a part it does not have (another tenant's
    included, worded alike), 400 for parts that cannot be merged as asked; `at` names the spec's field."""
    merges = services.merges
    if merges is None:
        raise BadRequest("this server does not merge adapters", code="invalid_merge", param=at)
    where = f"route {route!r}: {at}" if route and at == "merge" else at
    records = []
    for i, ref in enumerate(spec.ids):
        bare = _unqualified(ref, tenant)
        try:
            if bare is None:
                raise LookupError(ref)
            records.append(await _lookup(services, tenant, bare))
        except LookupError:
            raise ModelNotFound(
                f"{where}.ids[{i}]: the adapter {ref!r} does not exist; name one of your adapters "
                "(name or name@version)",
                param=f"{at}.ids[{i}]",
            ) from None
    parts = list(zip(records, spec.weights))
    try:
        adapter_id = await merges.ensure(tenant, parts, spec.method, services.disk_cache, services.work_pool)
    except MergeError as exc:
        raise BadRequest(f"{where}: {exc}", code="invalid_merge", param=at) from None
    return ResolvedModel(
        kind="route" if route else "merge",
        engine_adapter_id=adapter_id,
        served_model=spec.label(tuple(record.ref for record in records)),
        route=route,
        variant=variant,
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
    except (AdapterNotFound, InvalidName) as exc:
        raise LookupError(ref) from exc


def _is_resident(services: Services) -> Callable[[str, AdapterRecord], bool]:
    """Whether the engine holds a version in a GPU slot or its CPU tier (its latest published stats)."""

    def is_resident(tenant: str, record: AdapterRecord) -> bool:
        stats = getattr(services.engine, "stats", None)  # None: no engine yet
        resident = getattr(stats(), "resident_adapters", ()) if stats is not None else ()
        return format_adapter_id(tenant, record.name, record.version) in resident

    return is_resident


def _adapter(
    tenant: str, record: AdapterRecord, *, route: str | None = None, variant: str | None = None
) -> ResolvedModel:
    return ResolvedModel(
        kind="route" if route else "adapter",
        engine_adapter_id=format_adapter_id(tenant, record.name, record.version),
        served_model=record.ref,
        route=route,
        variant=variant,
        tool_call_parser=record.tool_call_parser,
    )
