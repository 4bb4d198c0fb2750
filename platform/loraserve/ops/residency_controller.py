"""The operator's residency endpoints: what a placement loop uses to pre-load, pin and let go of adapters.

They live on the metrics listener, beside /metrics, and need the placement key (`--placement-key`;
ops/metrics_access.py): placement works across tenants and names adapters tenant-qualified, which
tenants must never see, so the tenant API (admin keys included) cannot reach them.

- `GET /v1/residency`: every adapter version in a GPU slot or the CPU tier, with its pins.
- `POST /v1/residency/preload {"adapter": "tenant/name[@version]", "level": "gpu"|"cpu", "pin": false}`:
  bring it there without a request (`name` alone: its latest version), behind every waiting request's
  adapter; `pin` (level gpu only) keeps its GPU slot until unpinned. 202: the load runs in the
  background; GET /v1/residency or vllm:lora_adapter_loaded show when it landed.
- `POST /v1/residency/unpin {"adapter": ..., "unload": false}`: drop the operator's pin (resident,
  evictable); `unload` also frees its slot and CPU-tier row unless a request holds it.

Operator pins hold at most `max_loras - 1` slots (409 `pin_limit` beyond), so requests for every other
adapter always find one.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from adapter_format.errors import InvalidName
from adapter_format.names import check_tenant, format_adapter_id, split_tenant
from adapters_store import AdapterNotFound
from engine.lora.router_names import router_name
from loraserve.errors import BadRequest, Conflict, NotFound, ServiceUnavailable
from loraserve.json_guard import require_json_body
from loraserve.ops.metrics_access import MetricsAccess
from loraserve.services import Services


class PreloadRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    adapter: str  # tenant/name or tenant/name@version
    level: Literal["gpu", "cpu"] = "gpu"
    pin: bool = False


class UnpinRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    adapter: str
    unload: bool = False


class PlacementDone(msgspec.Struct, frozen=True, kw_only=True):
    adapter: str  # the engine's adapter id: tenant/name@version
    adapter_name: str  # what vllm:lora_adapter_loaded calls it: tenant/name


class ResidentAdapter(msgspec.Struct, frozen=True, kw_only=True):
    adapter: str  # tenant/name@version
    adapter_name: str  # tenant/name
    level: str  # "gpu" | "cpu"
    pinned: bool  # not evictable now (running requests or an operator's pin)
    placed: bool  # an operator's pin holds it
    rank: int


class Residency(msgspec.Struct, frozen=True, kw_only=True):
    max_gpu_lora_adapters: int
    max_operator_pins: int
    adapters: list[ResidentAdapter]


class ResidencyController(Controller):
    # Not in the API schema: the operator's port, not the tenant API.
    # Whole paths on the handlers, no controller prefix: the metrics listener admits handlers by their
    # own paths (ops/metrics_access.py).
    tags = ["ops"]

    @get(
        "/v1/residency",
        include_in_schema=False,
        summary="Adapters in GPU slots and the CPU tier, with their pins",
    )
    async def show(
        self,
        request: Request,
        services: NamedDependency[Services],
        metrics_access: NamedDependency[MetricsAccess],
    ) -> Residency:
        metrics_access.check_placement(request)
        stats = _stats(services)
        return Residency(
            max_gpu_lora_adapters=stats.max_loras,
            max_operator_pins=stats.max_loras - 1,
            adapters=[
                ResidentAdapter(
                    adapter=r.adapter_id,
                    adapter_name=router_name(r.adapter_id),
                    level=r.level,
                    pinned=r.pinned,
                    placed=r.placed,
                    rank=r.rank,
                )
                for r in stats.lora_residency
            ],
        )

    @post(
        "/v1/residency/preload",
        include_in_schema=False,
        status_code=202,
        guards=[require_json_body],
        summary="Load an adapter without a request",
    )
    async def preload(
        self,
        request: Request,
        data: JSONBody[PreloadRequest],
        services: NamedDependency[Services],
        metrics_access: NamedDependency[MetricsAccess],
    ) -> PlacementDone:
        metrics_access.check_placement(request)
        if data.pin and data.level != "gpu":
            raise BadRequest("only an adapter preloaded into a GPU slot can be pinned", param="pin")
        adapter_id = await _engine_id(services, data.adapter)
        if data.pin:
            stats = _stats(services)
            placed = {r.adapter_id for r in stats.lora_residency if r.placed} - {adapter_id}
            if len(placed) >= stats.max_loras - 1:
                raise Conflict(
                    f"{len(placed)} adapters are pinned already, the most of max_loras {stats.max_loras} "
                    "operator pins may hold (one slot stays free for requests); unpin one first",
                    code="pin_limit",
                )
        services.engine.preload_adapters([adapter_id], data.level, data.pin)
        return PlacementDone(adapter=adapter_id, adapter_name=router_name(adapter_id))

    @post(
        "/v1/residency/unpin",
        include_in_schema=False,
        status_code=200,
        guards=[require_json_body],
        summary="Drop an operator's pin",
    )
    async def unpin(
        self,
        request: Request,
        data: JSONBody[UnpinRequest],
        services: NamedDependency[Services],
        metrics_access: NamedDependency[MetricsAccess],
    ) -> PlacementDone:
        metrics_access.check_placement(request)
        adapter_id = await _engine_id(services, data.adapter)
        services.engine.unpin_adapters([adapter_id], data.unload)
        return PlacementDone(adapter=adapter_id, adapter_name=router_name(adapter_id))


def _stats(services: Services):
    stats = services.engine.stats() if services.engine is not None else None
    if stats is None:
        raise ServiceUnavailable("the model is still loading; retry shortly", code="model_not_ready")
    return stats


async def _engine_id(services: Services, adapter: str) -> str:
    """The engine id of `tenant/name` (its latest version) or `tenant/name@version`."""
    tenant, ref = split_tenant(adapter)
    if tenant is None or not ref:
        raise BadRequest(
            f"adapter {adapter!r} must be tenant-qualified: tenant/name or tenant/name@version",
            param="adapter",
        )
    try:
        check_tenant(tenant)
        record = await services.adapter_lookup.resolve(services.adapter_store, tenant, ref)
    except (AdapterNotFound, InvalidName):
        raise NotFound(f"adapter {adapter!r} does not exist", code="adapter_not_found") from None
    return format_adapter_id(tenant, record.name, record.version)
