"""vLLM's dynamic LoRA endpoints, mapped onto the tenant's adapter store.

`POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}` validates the folder at `lora_path` exactly
as an upload and stores it as the next version of `lora_name`; `POST /v1/unload_lora_adapter {lora_name}`
deletes every version (refused with 409 while a route needs one). Admin keys only. `lora_path` must lie under
a folder the operator allowed with `--allowed-lora-paths`, and so must the files in it, symlinks resolved
(local_folder.py); without that flag runtime loading is off, as vLLM keeps it off unless
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set. Answers are vLLM's plain-text lines, and its statuses: an empty
name or path is a 400, a folder that is not there a 404 (so is one outside the allowed folders: the
answer tells nothing about the rest of the disk), an adapter that fails validation a 400 (uploads
answer 422), and unloading a name that has no adapter a 404, even a name no adapter could have.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec
from litestar import Controller, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from adapters_store import AdapterNotFound, InvalidAdapter
from loraserve.adapters import service
from loraserve.adapters.local_folder import OUTSIDE, contained, open_adapter_files
from loraserve.errors import BadRequest, NotFound, PermissionDenied
from loraserve.json_guard import require_json_body
from loraserve.openapi import BEARER_SECURITY
from loraserve.services import Services
from loraserve.tenancy import InvalidName, Principal, require_admin

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
MAX_NAME_CHARS = 255  # NAME_MAX on Linux: longer names cannot exist, so such a path is malformed


class LoadLoRAAdapterRequest(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM sends it; names are what identify adapters here


class RuntimeLoadingDisabled(PermissionDenied):
    code = "runtime_lora_loading_disabled"


class RuntimeLoRAController(Controller):
    path = "/v1"
    tags = ["adapters"]
    security = BEARER_SECURITY
    guards = [require_json_body]

    @post("/load_lora_adapter", status_code=200, summary="vLLM's: load a PEFT folder as the next version")
    async def load(
        self,
        data: JSONBody[LoadLoRAAdapterRequest],
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> Response[str]:
        require_admin(principal)
        if not data.lora_name or not data.lora_path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        folder = _allowed_folder(services, data.lora_path)
        if not data.load_inplace and await _exists(services, principal, data.lora_name):
            raise BadRequest(
                f"The lora adapter '{data.lora_name}' has already been loaded. "
                "Pass load_inplace: true to load a new version of it.",
                code="adapter_exists",
                param="lora_name",
            )
        try:
            record = await _store(services, principal, data, folder)
        except (InvalidAdapter, InvalidName) as exc:  # vLLM's 400, not the uploads' 422
            raise BadRequest(str(exc), code=getattr(exc, "code", None) or "invalid_adapter") from None
        return Response(
            f"Success: LoRA adapter '{data.lora_name}' added successfully (version {record.version})."
        )

    @post("/unload_lora_adapter", status_code=200, summary="vLLM's: delete every version of an adapter")
    async def unload(
        self,
        data: JSONBody[UnloadLoRAAdapterRequest],
        services: NamedDependency[Services],
        principal: NamedDependency[Principal],
    ) -> Response[str]:
        require_admin(principal)
        if not data.lora_name:
            raise BadRequest("'lora_name' must be provided.", param="lora_name")
        try:
            await service.delete_adapter(services, principal, data.lora_name)
        except (AdapterNotFound, InvalidName):  # a name no adapter can have is not found
            raise NotFound(
                f"The lora adapter '{data.lora_name}' cannot be found.", code="adapter_not_found"
            ) from None
        return Response(f"Success: LoRA adapter '{data.lora_name}' removed successfully.")


def _allowed_folder(services: Services, lora_path: str) -> Path:
    """The real folder behind `lora_path`, if it lies under an allowed root; the caller's own path is the
    only one an error names."""
    roots = services.allowed_lora_paths
    if not roots:
        raise RuntimeLoadingDisabled(
            "runtime adapter loading is off on this server; upload adapters with POST /v1/adapters, or ask "
            "the operator to start it with --allowed-lora-paths"
        )
    if lora_path.startswith("s3://"):
        raise BadRequest(
            "lora_path must be a local folder; adapters in S3 are uploaded with POST /v1/adapters",
            param="lora_path",
        )
    too_long = len(lora_path) > MAX_PATH_CHARS or any(len(n) > MAX_NAME_CHARS for n in lora_path.split("/"))
    if "\x00" in lora_path or too_long:  # os calls raise on these: the caller's 400 (a missing folder: 404)
        raise BadRequest(
            f"lora_path must be a folder path of at most {MAX_PATH_CHARS} characters, with names of at most "
            f"{MAX_NAME_CHARS}, without NUL characters",
            param="lora_path",
        )
    folder = Path(os.path.realpath(lora_path))
    if not contained(folder, roots):
        raise NotFound(
            f"no adapter folder at lora_path {lora_path!r}: it {OUTSIDE}", code="adapter_path_not_found"
        )
    try:
        is_dir = folder.is_dir()
    except OSError:  # e.g. a name longer than the file system allows
        is_dir = False
    if not is_dir:
        raise NotFound(f"no adapter folder at lora_path {lora_path!r}", code="adapter_path_not_found")
    return folder


async def _store(services: Services, principal: Principal, data: LoadLoRAAdapterRequest, folder: Path) -> Any:
    """The folder's adapter files, opened where they are confined, stored as the next version."""
    files, streams = await asyncio.to_thread(
        open_adapter_files, folder, services.allowed_lora_paths, data.lora_path
    )
    try:
        return await service.store_adapter(services, principal, data.lora_name, files)
    finally:
        for stream in streams:
            stream.close()


async def _exists(services: Services, principal: Principal, name: str) -> bool:
    try:
        await services.adapter_lookup.call(services.adapter_store.versions, principal.tenant, name)
    except AdapterNotFound:
        return False
    return True
