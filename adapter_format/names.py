"""Names and ids: the one place for every rule about what a tenant, adapter or route may be called, and how
references and engine adapter ids are written and read.

- Names (tenants, adapters, routes, cache groups): 1 to 64 of [A-Za-z0-9._-], starting with a letter or
  digit (no hidden `.x`), with no `..`. They become adapter-store paths, S3 keys, Redis key segments and
  file names of the embedded config store, so the syntax is strict. `@` is excluded because it separates
  name and version, `/` because it separates tenant and name (and the store layout's levels).
- Versions: positive integers without leading zeros, at most 18 digits (VERSION_PATTERN), so they fit an
  int64 wherever they go.
- References: `name` (the latest version) or `name@version` (`parse_ref`, `format_ref`).
- Engine adapter ids: `tenant/name@version` for one committed version of one tenant's adapter, and
  `tenant/merge+<key>` for a merge of its adapters. The tenant is part of every id, so two tenants'
  adapters of one name never share a GPU slot or a KV prefix; `+` is in no name, so a merge id never names
  a stored version.
- Tenant-qualified names: `tenant/name`, as clients may write `model` and cluster routers know an adapter
  (`split_tenant`, `strip_version`).

Everything here is pure string work (no I/O), importable by the engine, the store and the server alike.
"""

from __future__ import annotations

import re

from adapter_format.errors import InvalidName

MAX_NAME_LENGTH = 64
NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
VERSION_PATTERN = r"[1-9][0-9]{0,17}"  # positive, no leading zeros, fits an int64
_VERSION = re.compile(VERSION_PATTERN)
MERGE_MARK = "merge+"
_MERGE_KEY = re.compile(r"[0-9a-f]{32}")
_ID_FORM = "tenant/name@version, e.g. acme/support-bot@3"


def check_name(value: object, what: str = "name") -> str:
    """Return `value` when it is a valid name; raise InvalidName saying what is wrong and the rule."""
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string (got {type(value).__name__})")
    if not value:
        raise InvalidName(f"{what} is empty; {NAME_RULE}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidName(f"{what} is {len(value)} characters long; {NAME_RULE}")
    if "@" in value:
        raise InvalidName(
            f"{what} {value!r} contains '@', which separates name and version (name@2); {NAME_RULE}"
        )
    if ".." in value:
        raise InvalidName(f"{what} {value!r} contains '..'; {NAME_RULE}")
    if "/" in value or "\\" in value:
        raise InvalidName(f"{what} {value!r} contains a path separator; {NAME_RULE}")
    if not _NAME.fullmatch(value):
        raise InvalidName(f"{what} {value!r} is invalid: {NAME_RULE}")
    return value


def check_tenant(value: object) -> str:
    return check_name(value, "tenant")


def check_adapter_name(value: object) -> str:
    return check_name(value, "adapter name")


def check_route_name(value: object) -> str:
    return check_name(value, "route name")


def is_valid_name(value: object) -> bool:
    """For names read back from storage (store layout, config store): stray entries are skipped, not
    raised on."""
    return isinstance(value, str) and bool(_NAME.fullmatch(value)) and ".." not in value


def check_version(version: object) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidName(f"adapter version must be a positive integer (got {version!r})")
    return version


def parse_version(segment: str) -> int | None:
    """A version as written (a layout segment, the part after `@`), or None for anything else."""
    return int(segment) if _VERSION.fullmatch(segment) else None


def parse_ref(ref: object) -> tuple[str, int | None]:
    """`name` -> (name, None: the latest); `name@3` -> (name, 3); InvalidName otherwise."""
    if not isinstance(ref, str):
        raise InvalidName(
            f"adapter reference must be a string like 'name' or 'name@2' (got {type(ref).__name__})"
        )
    name, at, version = ref.partition("@")
    if not at:
        return check_adapter_name(name), None
    parsed = parse_version(version)
    if parsed is None:
        raise InvalidName(
            f"adapter reference {ref!r}: the version after '@' must be a positive integer without leading "
            "zeros (name@2)"
        )
    return check_adapter_name(name), parsed


def format_ref(name: str, version: int | None) -> str:
    """`name@version`, or `name` alone for the latest version (None)."""
    return name if version is None else f"{name}@{version}"


def format_adapter_id(tenant: str, name: str, version: int) -> str:
    """The engine's id of one committed adapter version of one tenant (names checked)."""
    check_tenant(tenant)
    check_adapter_name(name)
    check_version(version)
    return f"{tenant}/{format_ref(name, version)}"


def parse_adapter_id(adapter_id: object) -> tuple[str, str, int]:
    """`tenant/name@version` -> (tenant, name, version); InvalidName (a ValueError) names what is wrong."""
    if not isinstance(adapter_id, str):
        raise InvalidName(f"adapter id must be a string (got {type(adapter_id).__name__})")
    tenant, slash, ref = adapter_id.partition("/")
    if not slash:
        raise InvalidName(f"adapter id {adapter_id!r} has no tenant; use {_ID_FORM}")
    check_tenant(tenant)
    name, version = parse_ref(ref)
    if version is None:
        raise InvalidName(f"adapter id {adapter_id!r} has no version; use {_ID_FORM}")
    return tenant, name, version


def format_merge_id(tenant: str, key: str) -> str:
    """The engine id of one tenant's merge; `key` is 32 lowercase hex digits."""
    check_tenant(tenant)
    if not _MERGE_KEY.fullmatch(key):
        raise ValueError(f"merge key {key!r} must be 32 lowercase hex digits")
    return f"{tenant}/{MERGE_MARK}{key}"


def parse_merge_id(adapter_id: str) -> tuple[str, str] | None:
    """(tenant, key) of a merge id; None for any other id."""
    tenant, slash, rest = adapter_id.partition("/")
    key = rest[len(MERGE_MARK) :]
    if not slash or not rest.startswith(MERGE_MARK) or not _MERGE_KEY.fullmatch(key):
        return None
    return tenant, key


def split_adapter_id(adapter_id: str) -> tuple[str, str, int] | None:
    """(tenant, name, version) of any engine adapter id, for labels: a merge's name is `merge+<key>` and
    its version 0; None for an id of neither form."""
    merge = parse_merge_id(adapter_id)
    if merge is not None:
        return merge[0], MERGE_MARK + merge[1], 0
    try:
        return parse_adapter_id(adapter_id)
    except InvalidName:
        return None


def split_tenant(qualified: str) -> tuple[str | None, str]:
    """`tenant/name` -> (tenant, name); a name without a tenant -> (None, name)."""
    tenant, slash, rest = qualified.partition("/")
    return (tenant, rest) if slash else (None, qualified)


def strip_version(adapter_id: str) -> str:
    """`tenant/name@3` -> `tenant/name`: what cluster routers call an adapter; an id without a valid
    `@version` suffix comes back unchanged."""
    base, at, version = adapter_id.rpartition("@")
    return base if at and base and parse_version(version) is not None else adapter_id
