"""Turn an `Authorization: Bearer KEY` header into a Principal, or refuse it.

Keys come from the `--api-keys` file (hashed at load) and from the config store (stored hashed).
File keys win when both know a hash. Lookups are by SHA-256 of the presented key, so lookup timing can
only tell an attacker about the hash of a guess they already hold; the final equality check still uses
`hmac.compare_digest` so no code path compares secrets byte by byte.

Open mode: with no key in the file and none in the store, every request runs as tenant `default`,
admin. It only ever closes: once any key appears in the store the authenticator leaves open mode for
good, and deleting every key later locks everyone out rather than silently opening the server again.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any, Protocol

from loraserve.tenancy.errors import Forbidden, Unauthorized
from loraserve.tenancy.keys import ApiKey, hash_key
from loraserve.tenancy.principal import OPEN_MODE_PRINCIPAL, Principal

_HOW = "send 'Authorization: Bearer YOUR_API_KEY'"


class KeySource(Protocol):
    """What the authenticator needs from a config store (ConfigStore and CachedConfigStore fit)."""

    async def get_key(self, key_hash: str) -> ApiKey | None: ...

    async def list_keys(self) -> list[ApiKey]: ...


class Authenticator:
    def __init__(self, keys: Iterable[ApiKey] = (), store: KeySource | None = None) -> None:
        self._file_keys = {key.key_hash: key for key in keys}
        self._store = store
        # Provisional until refresh_open_mode() has asked the store; authenticate() asks too.
        self._open = not self._file_keys

    @classmethod
    async def create(cls, keys: Iterable[ApiKey] = (), store: KeySource | None = None) -> Authenticator:
        """Build one and settle open mode now, so the server can warn at start."""
        auth = cls(keys, store)
        await auth.refresh_open_mode()
        return auth

    @property
    def open_mode(self) -> bool:
        return self._open

    async def refresh_open_mode(self) -> bool:
        """Leave open mode if the store now holds keys; never re-enter it."""
        if self._open and self._store is not None and await self._store.list_keys():
            self._open = False
        return self._open

    async def authenticate(self, authorization: str | None) -> Principal:
        """The caller's Principal; Unauthorized for a missing, malformed or unknown key."""
        if self._open and await self.refresh_open_mode():
            return OPEN_MODE_PRINCIPAL
        key = parse_bearer(authorization)
        digest = hash_key(key)
        record = self._file_keys.get(digest)
        if record is None and self._store is not None:
            record = await self._store.get_key(digest)
        if record is None or not hmac.compare_digest(record.key_hash, digest):
            raise Unauthorized(f"invalid API key; {_HOW} with a key your operator issued")
        return Principal.from_key(record)


def authorization_header(headers: Any) -> str | None:
    """The request's one `Authorization` header, None without one. Two or more are refused (401): a proxy
    in front could check one while this server read another."""
    values = headers.getall("authorization", [])
    if len(values) > 1:
        raise Unauthorized(f"the request has {len(values)} Authorization headers; {_HOW}, once")
    return values[0] if values else None


def parse_bearer(authorization: str | None) -> str:
    """The key of `Bearer KEY` (scheme case-insensitive); Unauthorized otherwise."""
    if authorization is None or not authorization.strip():
        raise Unauthorized(f"missing API key; {_HOW}")
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or any(c.isspace() for c in key):
        raise Unauthorized(f"malformed Authorization header; {_HOW}")
    return key


def require_admin(principal: Principal) -> Principal:
    if not principal.is_admin:
        raise Forbidden(
            f"this endpoint needs an admin key; the key used is a user key of tenant {principal.tenant!r}"
        )
    return principal
