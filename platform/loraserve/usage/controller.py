"""`GET /v1/usage` (admin): what the caller's own tenant used on this replica; never another tenant's."""

from __future__ import annotations

from litestar import Controller, Request, get
from litestar.di import NamedDependency

from loraserve.errors import BadRequest
from loraserve.openapi import BEARER_SECURITY
from loraserve.services import Services
from loraserve.tenancy import Principal
from loraserve.usage.service import TenantUsage, tenant_usage


class UsageController(Controller):
    path = "/v1/usage"
    tags = ["usage"]
    security = BEARER_SECURITY

    @get(summary="The caller's tenant usage on this replica")
    async def usage(
        self, request: Request, services: NamedDependency[Services], principal: NamedDependency[Principal]
    ) -> TenantUsage:
        if request.query_params:
            raise BadRequest("GET /v1/usage takes no parameters; it reports the tenant of the key used")
        return tenant_usage(services, principal)
