"""Tenant names, adapter names, versions and `name@version` references.

Names become path segments and S3 key segments, so the syntax is strict: 1 to 64 of [A-Za-z0-9._-],
starting with a letter or digit (no hidden `.x`, no `..` anywhere). `@` is excluded because
`name@version` is the reference syntax; `/` because it separates the layout's levels.
"""

from __future__ import annotations

import re

from adapters_store.errors import InvalidName

MAX_NAME_LENGTH = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_VERSION = re.compile(r"[1-9][0-9]{0,17}")
_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_tenant(tenant: str) -> str:
    return _check("tenant", tenant)


def check_name(name: str) -> str:
    return _check("adapter name", name)


def _check(what: str, value: str) -> str:
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string (got {type(value).__name__})")
    if "@" in value:
        raise InvalidName(
            f"{what} {value!r} contains '@', which separates name and version (name@2); {_RULE}"
        )
    if "/" in value or "\\" in value:
        raise InvalidName(f"{what} {value!r} contains a path separator; {_RULE}")
    if ".." in value:
        raise InvalidName(f"{what} {value!r} contains '..'; {_RULE}")
    if not _NAME.fullmatch(value):
        raise InvalidName(f"{what} {value!r} is invalid: {_RULE}")
    return value


def is_valid_name(value: str) -> bool:
    """For names read back from the layout: stray keys are skipped, not raised on."""
    return bool(_NAME.fullmatch(value)) and ".." not in value


def check_version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidName(f"adapter version must be a positive integer (got {version!r})")
    return version


def parse_version(segment: str) -> int | None:
    """A layout segment as a version number, or None for anything else (temp folders, stray keys)."""
    return int(segment) if _VERSION.fullmatch(segment) else None


def parse_ref(ref: str) -> tuple[str, int | None]:
    """`name` -> (name, None: the latest); `name@3` -> (name, 3)."""
    if not isinstance(ref, str):
        raise InvalidName(f"adapter reference must be a string (got {type(ref).__name__})")
    name, sep, version = ref.partition("@")
    if not sep:
        return check_name(name), None
    if not _VERSION.fullmatch(version):
        raise InvalidName(
            f"adapter reference {ref!r}: the version after '@' must be a positive integer (name@2)"
        )
    return check_name(name), int(version)


def format_ref(name: str, version: int) -> str:
    return f"{name}@{version}"
