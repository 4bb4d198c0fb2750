"""HTTP endpoints of the adapter store: upload, list, get, delete (docs/API_ADMIN.md)."""

from __future__ import annotations

from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from adapter_format.peft_config import MAX_CONFIG_BYTES
from adapters_store import StoreConfig
from adapters_store.config import MiB
from loraserve.adapters import service
from loraserve.adapters.schemas import Adapter, AdapterDeleted, AdapterDetail, AdapterList
from loraserve.openapi import BEARER_SECURITY
from loraserve.services import Services
from loraserve.tenancy import Principal

ServicesDep = NamedDependency[Services]
PrincipalDep = NamedDependency[Principal]
# Multipart headers and boundaries around the files; generous, as they are not what the limit is about.
_FORM_OVERHEAD_BYTES = 1 * MiB


def upload_limit_bytes(config: StoreConfig) -> int:
    """The largest request body an upload may need under the store's limits (413 beyond it)."""
    return max(config.max_archive_bytes, config.max_adapter_bytes + MAX_CONFIG_BYTES) + _FORM_OVERHEAD_BYTES


class AdaptersController(Controller):
    path = "/v1/adapters"
    tags = ["adapters"]
    security = BEARER_SECURITY
    request_max_body_size = upload_limit_bytes(StoreConfig())  # see adapters_controller() for others

    @post(status_code=HTTP_201_CREATED, summary="Upload an adapter (multipart: name, files or archive)")
    async def upload(self, request: Request, services: ServicesDep, principal: PrincipalDep) -> Adapter:
        return await service.upload_adapter(services, principal, request)

    @get(summary="The tenant's adapters, latest version of each")
    async def list_adapters(self, services: ServicesDep, principal: PrincipalDep) -> AdapterList:
        return await service.list_adapters(services, principal)

    @get("/{ref:str}", summary="One adapter with its versions (`name`), or one version (`name@version`)")
    async def get_adapter(
        self, ref: FromPath[str], services: ServicesDep, principal: PrincipalDep
    ) -> AdapterDetail | Adapter:
        return await service.get_adapter(services, principal, ref)

    @delete(
        "/{ref:str}", status_code=HTTP_200_OK, summary="Delete an adapter or one version (`name@version`)"
    )
    async def delete_adapter(
        self, ref: FromPath[str], services: ServicesDep, principal: PrincipalDep
    ) -> AdapterDeleted:
        return await service.delete_adapter(services, principal, ref)


def adapters_controller(config: StoreConfig) -> type[AdaptersController]:
    """The controller with its body limit sized for `config` (whose limits the store enforces again)."""
    limit = upload_limit_bytes(config)
    if limit == AdaptersController.request_max_body_size:
        return AdaptersController
    return type("AdaptersController", (AdaptersController,), {"request_max_body_size": limit})
