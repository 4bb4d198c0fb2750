"""Tenant, adapter and route names: one strict syntax for all three.

Names become file names in the embedded config store, Redis key segments and adapter-store paths,
so they are 1 to 64 of [A-Za-z0-9._-], starting with a letter or digit (no hidden `.x`), with no `..`.
`@` is excluded because `name@version` is the adapter reference syntax. This is the same rule as
`adapters_store.names`, restated here so the control plane's checks do not depend on the store's internals.
"""

from __future__ import annotations

import re

from loraserve.tenancy.errors import InvalidName

MAX_NAME_LENGTH = 64
NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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
    """For names read back from storage: stray entries are skipped, not raised on."""
    return isinstance(value, str) and bool(_NAME.fullmatch(value)) and ".." not in value
