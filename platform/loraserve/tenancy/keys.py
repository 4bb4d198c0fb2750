"""API keys: the stored record, hashing, and the `--api-keys` file (JSON or YAML).

A key is kept only as its SHA-256 hex digest. API keys are random, high-entropy secrets handed out
by operators, not passwords people choose, so a plain unsalted hash is enough to make a leaked store
useless for logging in, and it lets the server look a presented key up by its hash in one step (a
per-key salt would force trying every record).

File format, one entry per key:

    {"sk-alice-1": {"tenant": "alice", "role": "admin", "max_concurrent_requests": 8,
                    "weight": 2, "max_tokens_per_minute": 200000, "cache_group": "acme-support"},
     "sk-bob-1":   {"tenant": "bob", "role": "user"}}

`role` defaults to `user` (least privilege); `max_concurrent_requests` to the server-wide default;
`weight` (the tenant's share in the fair scheduler, relative to other tenants) to 1;
`max_tokens_per_minute` to no limit; `cache_group` to none: the tenant's prompts share the prefix
cache with its own requests only (loraserve.tenancy.cache_salt). Give every key of one tenant the same
weight and cache group.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec
import yaml

from adapter_format.names import check_name, check_tenant
from loraserve.tenancy.errors import InvalidKeysFile, InvalidName

Role = Literal["admin", "user"]
ROLES: tuple[str, ...] = ("admin", "user")
_ENTRY_FIELDS = {
    "tenant",
    "role",
    "max_concurrent_requests",
    "weight",
    "max_tokens_per_minute",
    "cache_group",
}
MAX_WEIGHT = 1_000_000.0  # weights are ratios; beyond this they only risk float trouble


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """One API key as stored: its hash, never the key itself."""

    key_hash: str  # sha256 hex of the key, see hash_key
    tenant: str
    role: Role = "user"
    max_concurrent_requests: int | None = None  # None: the server's default limit
    weight: float = 1.0  # the tenant's weight in the fair scheduler
    max_tokens_per_minute: int | None = None  # None: no token-rate limit
    # Tenants whose keys name the same group share prefix-cache blocks (a common system prompt); None:
    # the tenant shares with nobody else. A name (adapter_format/names.py).
    cache_group: str | None = None

    @property
    def key_id(self) -> str:
        """A short, non-secret handle for logs and metrics (a prefix of the hash, not of the key)."""
        return self.key_hash[:12]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_key_hash(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def load_api_keys(path: str | Path) -> list[ApiKey]:
    """Read an `--api-keys` file: `.json` as JSON, `.yaml`/`.yml` as YAML, anything else JSON then YAML."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidKeysFile(f"cannot read API keys file {str(path)!r}: {exc.strerror or exc}") from exc
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        # The parsers' messages quote the offending line, which may hold a key: report the position only.
        where = getattr(exc, "lineno", None) or getattr(getattr(exc, "problem_mark", None), "line", None)
        at = f" near line {where}" if where else ""
        raise InvalidKeysFile(f"API keys file {str(path)!r} is not valid JSON or YAML{at}") from None
    return parse_api_keys(data, source=str(path))


def parse_api_keys(data: object, *, source: str = "API keys") -> list[ApiKey]:
    """Validate `{KEY: {tenant, role?, max_concurrent_requests?, weight?, max_tokens_per_minute?,
    cache_group?}}` and hash the keys.

    Entries are named by position (`entry 2`), never by key, so error messages are safe to log.
    """
    example = '{"KEY": {"tenant": "acme", "role": "admin"}}'
    if not isinstance(data, Mapping) or not data:
        raise InvalidKeysFile(f"{source}: expected a non-empty mapping of key -> settings, like {example}")
    keys: list[ApiKey] = []
    for index, (key, entry) in enumerate(data.items(), start=1):
        where = f"{source}: entry {index}"
        if not isinstance(key, str) or not key or key != key.strip() or any(c.isspace() for c in key):
            raise InvalidKeysFile(f"{where}: the key must be a non-empty string without whitespace")
        if not isinstance(entry, Mapping):
            raise InvalidKeysFile(f"{where}: settings must be a mapping like {example}")
        unknown = sorted(set(map(str, entry)) - _ENTRY_FIELDS)
        if unknown:
            raise InvalidKeysFile(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_ENTRY_FIELDS)}")
        try:
            tenant = check_tenant(entry.get("tenant"))
            group = entry.get("cache_group")
            cache_group = None if group is None else check_name(group, "cache_group")
        except InvalidName as exc:
            raise InvalidKeysFile(f"{where}: {exc}") from None
        role = entry.get("role", "user")
        if role not in ROLES:
            raise InvalidKeysFile(f"{where}: role must be 'admin' or 'user' (got {role!r})")
        limit = _positive_int(entry, "max_concurrent_requests", where)
        tokens_per_minute = _positive_int(entry, "max_tokens_per_minute", where)
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= MAX_WEIGHT:
            raise InvalidKeysFile(f"{where}: weight must be a number in (0, {MAX_WEIGHT:g}] (got {weight!r})")
        keys.append(
            ApiKey(
                key_hash=hash_key(key),
                tenant=tenant,
                role=role,
                max_concurrent_requests=limit,
                weight=float(weight),
                max_tokens_per_minute=tokens_per_minute,
                cache_group=cache_group,
            )
        )
    return keys


def _positive_int(entry: Mapping, name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidKeysFile(f"{where}: {name} must be a positive integer (got {value!r})")
    return value
