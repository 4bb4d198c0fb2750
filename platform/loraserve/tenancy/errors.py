"""Errors of authentication, authorization and per-tenant limits.

Each carries the HTTP status and OpenAI-style error `code` the API answers with, so the app's one
exception table can map the whole family without knowing each class.
"""

from __future__ import annotations

from typing import ClassVar


class TenancyError(Exception):
    """Base class; `status_code` and `code` feed OpenAI's error body `{"error": {message, type, code}}`."""

    status_code: ClassVar[int] = 400
    code: ClassVar[str] = "invalid_request"


class Unauthorized(TenancyError):
    """No API key, a malformed Authorization header, or a key nobody configured (401)."""

    status_code = 401
    code = "invalid_api_key"


class Forbidden(TenancyError):
    """A valid key whose role may not do this (403): a user key on an admin endpoint."""

    status_code = 403
    code = "insufficient_permissions"


class TooManyRequests(TenancyError):
    """The tenant already runs its maximum of concurrent requests (429 with `Retry-After`)."""

    status_code = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # whole seconds, ready for the Retry-After header


class InvalidName(ValueError):
    """A tenant, adapter or route name outside the safe syntax (the API answers 422)."""


class InvalidKeysFile(ValueError):
    """An `--api-keys` file that cannot be read or whose entries are wrong; the message never shows a key."""
