"""Tenancy: API keys (hashed), principals, admin checks, name syntax (adapter_format/names.py), per-tenant concurrency and token limits,
and who may share the prefix cache."""

from adapter_format.names import (
    MAX_NAME_LENGTH,
    NAME_RULE,
    check_adapter_name,
    check_name,
    check_route_name,
    check_tenant,
    is_valid_name,
)
from loraserve.tenancy.auth import (
    Authenticator,
    KeySource,
    authorization_header,
    parse_bearer,
    require_admin,
)
from loraserve.tenancy.cache_salt import engine_cache_salt
from loraserve.tenancy.errors import (
    Forbidden,
    InvalidKeysFile,
    InvalidName,
    TenancyError,
    TooManyRequests,
    Unauthorized,
)
from loraserve.tenancy.keys import ROLES, ApiKey, Role, hash_key, is_key_hash, load_api_keys, parse_api_keys
from loraserve.tenancy.limiter import ConcurrencyLimiter, Lease
from loraserve.tenancy.principal import DEFAULT_TENANT, OPEN_MODE_PRINCIPAL, Principal
from loraserve.tenancy.token_limiter import TokenRateLimiter, TokenReservation

__all__ = [
    "DEFAULT_TENANT",
    "MAX_NAME_LENGTH",
    "NAME_RULE",
    "OPEN_MODE_PRINCIPAL",
    "ROLES",
    "ApiKey",
    "Authenticator",
    "ConcurrencyLimiter",
    "Forbidden",
    "InvalidKeysFile",
    "InvalidName",
    "KeySource",
    "Lease",
    "Principal",
    "Role",
    "TenancyError",
    "TokenRateLimiter",
    "TokenReservation",
    "TooManyRequests",
    "Unauthorized",
    "authorization_header",
    "check_adapter_name",
    "check_name",
    "check_route_name",
    "check_tenant",
    "engine_cache_salt",
    "hash_key",
    "is_key_hash",
    "is_valid_name",
    "load_api_keys",
    "parse_api_keys",
    "parse_bearer",
    "require_admin",
]
