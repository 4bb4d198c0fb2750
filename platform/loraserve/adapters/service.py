"""What the adapter endpoints do: store calls in worker threads, then the engine and caches told.

The store blocks (boto3, disk, validation), so every call runs in a worker thread and the event loop
keeps serving other requests meanwhile. Tenancy comes only from the principal: a tenant cannot even
name another tenant's adapters, so theirs answer exactly like missing ones.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from litestar import Request

from adapter_format.names import format_adapter_id
from adapters_store import parse_ref
from adapters_store.upload_intake import UploadIntake
from loraserve.adapters.multipart_reader import read_upload_body
from loraserve.adapters.schemas import Adapter, AdapterDeleted, AdapterDetail, AdapterList
from loraserve.adapters.upload_form import UploadForm
from loraserve.config_store import ConfigStoreError
from loraserve.name_conflicts import check_not_base_model, refuse_breaking_routes
from loraserve.routing.in_use import variants_needing
from loraserve.services import Services
from loraserve.tenancy import Principal, require_admin

log = logging.getLogger(__name__)


async def upload_adapter(services: Services, principal: Principal, request: Request) -> Adapter:
    """Validate and store the form's adapter as the next version of its name.

    The form's files are written into a staging folder as they arrive (one copy on disk, bad weights
    refused at their header), then checked whole and stored; the folder goes whatever happens."""
    require_admin(principal)  # before reading the body: a user key gets its 403 without uploading
    store = services.adapter_store
    async with services.upload_slots.acquire(principal.tenant):  # 429 past the tenant's parallel uploads
        staging_block = store.staging()
        staging = await asyncio.to_thread(staging_block.__enter__)
        try:
            form = UploadForm(await asyncio.to_thread(UploadIntake, staging, store.config, store.shape))
            await read_upload_body(request, form)
            upload = form.result()
            return await store_adapter(
                services, principal, upload.name, upload.source, tool_call_parser=upload.tool_call_parser
            )
        finally:
            await asyncio.to_thread(staging_block.__exit__, None, None, None)


async def store_adapter(
    services: Services, principal: Principal, name: str, source: Any, tool_call_parser: str | None = None
) -> Adapter:
    """Validate and store `source` (a form's files, an archive or a folder) as the next version of `name`."""
    check_not_base_model(name, services.base_model_id, "adapter")
    put = services.adapter_store.put
    record = await asyncio.to_thread(put, principal.tenant, name, source, tool_call_parser=tool_call_parser)
    services.adapter_lookup.invalidate(principal.tenant, record.name)
    await _announce(services, principal.tenant, record.name, "put")
    return Adapter.from_record(record)


async def list_adapters(services: Services, principal: Principal) -> AdapterList:
    records = await services.adapter_lookup.call(services.adapter_store.list, principal.tenant)
    return AdapterList(data=[Adapter.from_record(r) for r in records])


async def get_adapter(services: Services, principal: Principal, ref: str) -> AdapterDetail | Adapter:
    """`name`: the latest record with every version; `name@version`: that version's record."""
    name, version = parse_ref(ref)
    store, call = services.adapter_store, services.adapter_lookup.call
    if version is not None:
        return Adapter.from_record(await call(store.get, principal.tenant, name, version))
    records = [Adapter.from_record(r) for r in await call(store.versions, principal.tenant, name)]
    return AdapterDetail(name=name, latest=records[-1], versions=records)


async def delete_adapter(services: Services, principal: Principal, ref: str) -> AdapterDeleted:
    """Delete one version (`name@version`) or all of them; the engine stops taking them at once.

    AdapterInUse (409) if a route of the tenant needs what would be deleted. Requests already running
    on a deleted version finish on it; the engine refuses new ones.
    """
    require_admin(principal)
    tenant = principal.tenant
    name, version = parse_ref(ref)
    store = services.adapter_store
    # No route write naming this adapter lands while it is deleted, and the routes are read after that
    # guard is up, from the config store itself: a route written concurrently is seen, never left dangling.
    async with services.config_store.adapter_deletion(tenant, name) as current_routes:
        existing = [r.version for r in await services.adapter_lookup.call(store.versions, tenant, name)]
        deleted = existing if version is None else [version]
        remaining = [v for v in existing if v not in deleted]
        refuse_breaking_routes(ref, variants_needing(await current_routes(), name, deleted, remaining))
        records = await asyncio.to_thread(store.delete, tenant, name, version)
        services.adapter_lookup.invalidate(tenant, name, deleted=True)
    await _announce(services, tenant, name, "delete")
    for record in records:
        if services.engine is not None:
            services.engine.forget_adapter(format_adapter_id(tenant, record.name, record.version))
        # Pinned copies (a load in progress) stay until released; LRU removes them later.
        await asyncio.to_thread(services.disk_cache.discard, tenant, record.name, record.version)
    log.info("tenant %s deleted adapter %s versions %s", tenant, name, [r.version for r in records])
    return AdapterDeleted(name=name, versions=[r.version for r in records])


async def _announce(services: Services, tenant: str, name: str, op: Literal["put", "delete"]) -> None:
    """Tell the other replicas (their adapter lookups); without Redis they notice within the lookup TTL."""
    try:
        await services.config_store.announce_adapter_change(tenant, name, op)
    except ConfigStoreError as exc:
        log.warning(
            "adapter %s/%s changed (%s) but the other replicas could not be told (%s); they see it within %g s",
            tenant,
            name,
            op,
            exc,
            services.adapter_lookup.ttl_s,
        )
