"""The default config store: one JSON file per record under a directory (./.loraserve/config).

    {root}/routes/{tenant}/{route}.json      a Route
    {root}/keys/{sha256 hex}.json            an ApiKey (the hash, never the key)

A file per record keeps every write a single atomic replace (atomic.py) with no lock and no
read-modify-write of a shared file, and makes tenant namespacing a directory. Names are validated
before they become paths (adapter_format/names.py), so no record can escape its folder.

Change events reach subscribers of this instance only: one server process per directory. Replicas
that must see each other's changes share a Redis store instead. File I/O runs in a worker thread so
the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from adapter_format.names import check_route_name, check_tenant, is_valid_name
from loraserve.config_store.atomic import atomic_delete, atomic_write
from loraserve.config_store.base import ConfigStore
from loraserve.config_store.errors import ConfigStoreError, ConfigStoreUnavailable
from loraserve.config_store.events import ConfigEvent, EventCallback, Subscribers
from loraserve.routing.route import Route
from loraserve.tenancy.keys import ApiKey, is_key_hash

log = logging.getLogger(__name__)

DEFAULT_CONFIG_DIR = Path(".loraserve") / "config"
_SUFFIX = ".json"
T = TypeVar("T")


class EmbeddedConfigStore(ConfigStore):
    def __init__(self, root: str | os.PathLike[str] = DEFAULT_CONFIG_DIR) -> None:
        self.root = Path(root)
        self._subscribers = Subscribers()

    def __repr__(self) -> str:
        return f"EmbeddedConfigStore({str(self.root)!r})"

    # routes

    async def get_route(self, tenant: str, name: str) -> Route | None:
        if not (is_valid_name(tenant) and is_valid_name(name)):
            return None  # nothing can be stored under such a name (model ids like "org/model" land here)
        return await self._io(_read_record, self._route_path(tenant, name), Route)

    async def put_route(self, tenant: str, route: Route) -> None:
        await self._io(atomic_write, self._route_path(tenant, route.name), msgspec.json.encode(route))
        self._subscribers.emit(ConfigEvent(kind="route", op="put", tenant=tenant, name=route.name))

    async def delete_route(self, tenant: str, name: str) -> bool:
        if not (is_valid_name(tenant) and is_valid_name(name)):
            return False
        deleted = await self._io(atomic_delete, self._route_path(tenant, name))
        if deleted:
            self._subscribers.emit(ConfigEvent(kind="route", op="delete", tenant=tenant, name=name))
        return deleted

    async def list_routes(self, tenant: str) -> list[Route]:
        if not is_valid_name(tenant):
            return []
        routes = await self._io(_read_folder, self.root / "routes" / tenant, Route)
        return sorted(routes, key=lambda route: route.name)

    # keys

    async def get_key(self, key_hash: str) -> ApiKey | None:
        return await self._io(_read_record, self._key_path(key_hash), ApiKey)

    async def put_key(self, key: ApiKey) -> None:
        check_tenant(key.tenant)
        await self._io(atomic_write, self._key_path(key.key_hash), msgspec.json.encode(key))
        self._subscribers.emit(ConfigEvent(kind="key", op="put", name=key.key_hash))

    async def delete_key(self, key_hash: str) -> bool:
        deleted = await self._io(atomic_delete, self._key_path(key_hash))
        if deleted:
            self._subscribers.emit(ConfigEvent(kind="key", op="delete", name=key_hash))
        return deleted

    async def list_keys(self) -> list[ApiKey]:
        keys = await self._io(_read_folder, self.root / "keys", ApiKey)
        return sorted(keys, key=lambda key: (key.tenant, key.key_hash))

    async def announce_adapter_change(self, tenant: str, name: str, op: Literal["put", "delete"]) -> None:
        self._subscribers.emit(ConfigEvent(kind="adapter", op=op, tenant=tenant, name=name))

    # lifecycle

    async def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        return self._subscribers.add(callback)

    async def ping(self) -> None:
        await self._io(_check_writable_dir, self.root)

    async def close(self) -> None:
        return None

    # helpers

    def _route_path(self, tenant: str, name: str) -> Path:
        return self.root / "routes" / check_tenant(tenant) / f"{check_route_name(name)}{_SUFFIX}"

    def _key_path(self, key_hash: str) -> Path:
        if not is_key_hash(key_hash):
            raise ValueError(
                "key_hash must be 64 lowercase hex digits (sha256 of the key, see tenancy.hash_key)"
            )
        return self.root / "keys" / f"{key_hash}{_SUFFIX}"

    async def _io(self, fn: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise ConfigStoreUnavailable(f"embedded config store at {str(self.root)!r}: {exc}") from exc


def _read_record(path: Path, type_: type[T]) -> T | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.DecodeError as exc:
        raise ConfigStoreError(
            f"config record {str(path)!r} is corrupt ({exc}); fix or delete the file"
        ) from exc


def _read_folder(folder: Path, type_: type[T]) -> list[T]:
    """Every record in a folder; temp files, stray names and corrupt files are skipped (and logged)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    records = []
    for file_name in names:
        stem = file_name[: -len(_SUFFIX)]
        if not file_name.endswith(_SUFFIX) or not (is_valid_name(stem) or is_key_hash(stem)):
            continue
        try:
            record = _read_record(folder / file_name, type_)
        except ConfigStoreError as exc:
            log.warning("skipping %s", exc)
            continue
        if record is not None:
            records.append(record)
    return records


def _check_writable_dir(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if not os.access(root, os.W_OK | os.X_OK):
        raise PermissionError(13, "directory is not writable", str(root))
