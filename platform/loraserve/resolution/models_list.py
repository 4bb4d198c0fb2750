"""`GET /v1/models` for one tenant: the base model, its adapters (every version too) and its routes; and
`GET /v1/models/{id}`, one of them (the SDK's `models.retrieve`)."""

from __future__ import annotations

import calendar
import functools
import time
from typing import Literal

import msgspec

from adapters_store import AdapterRecord
from loraserve.resolution.resolved import ModelNotFound
from loraserve.services import Services
from loraserve.tenancy import Principal

OWNED_BY_SERVER = "loraserve"


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's model object plus vLLM's `root` and `parent`, and which kind of name `id` is."""

    id: str
    created: int  # unix seconds
    owned_by: str  # "loraserve" for the base model, else the tenant
    root: str  # what serves it: the base model, `name@version`, or the route's name
    parent: str | None  # the base model for adapters and routes
    kind: Literal["base", "adapter", "route"]
    max_model_len: int | None = None  # the context length, on the base model's card (as vLLM)
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


async def list_models(services: Services, principal: Principal) -> ModelList:
    """Names the tenant may send as `model`: `name` means the latest version, `name@version` one version."""
    tenant, base = principal.tenant, services.base_model_id
    now = int(time.time())
    records = await services.adapter_lookup.call(
        functools.partial(services.adapter_store.list, tenant, all_versions=True)
    )
    routes = await services.config_store.list_routes(tenant)
    cards = [
        ModelCard(
            id=base,
            created=now,
            owned_by=OWNED_BY_SERVER,
            root=base,
            parent=None,
            kind="base",
            max_model_len=services.max_model_len,
        )
    ]
    latest: dict[str, AdapterRecord] = {}
    for record in records:  # sorted by (name, version): the last one of a name is its latest
        latest[record.name] = record
    # Each id once, as resolution reads it: the base model first, then routes, then adapters (names
    # stored before the base model's id was refused to them are shadowed the same way).
    routed = {route.name for route in routes}
    for name, record in latest.items():
        if name not in routed and name != base:
            cards.append(_adapter_card(name, record, tenant, base))
    cards.extend(_adapter_card(record.ref, record, tenant, base) for record in records)
    cards.extend(
        ModelCard(id=route.name, created=now, owned_by=tenant, root=route.name, parent=base, kind="route")
        for route in routes
        if route.name != base
    )
    return ModelList(data=cards)


async def retrieve_model(services: Services, principal: Principal, model_id: str) -> ModelCard:
    """The card `GET /v1/models` lists under `model_id` (also written `your-tenant/name`); 404 otherwise,
    the same answer for another tenant's names as for names nobody has."""
    prefix, slash, rest = model_id.partition("/")
    wanted = rest if slash and prefix == principal.tenant and model_id != services.base_model_id else model_id
    for card in (await list_models(services, principal)).data:
        if card.id == wanted:
            return card
    raise ModelNotFound(
        f"The model {model_id!r} does not exist; GET /v1/models lists the base model, your adapters and "
        "your routes"
    )


def _adapter_card(model_id: str, record: AdapterRecord, tenant: str, base: str) -> ModelCard:
    return ModelCard(
        id=model_id,
        created=_unix(record.created_at),
        owned_by=tenant,
        root=record.ref,
        parent=base,
        kind="adapter",
    )


def _unix(iso_utc: str) -> int:
    try:
        return calendar.timegm(time.strptime(iso_utc, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:  # a manifest from elsewhere with another format: the date is informative only
        return 0
