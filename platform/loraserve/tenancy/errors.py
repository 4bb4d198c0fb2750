"""Errors of authentication, authorization and per-tenant limits.

The HTTP status and error code of each are in the app's one exception table (loraserve/errors.py,
`status_and_code`); these classes know nothing of HTTP, so the table may import them and not the reverse.
"""

from __future__ import annotations

from adapter_format.errors import InvalidName  # noqa: F401 (one class for names: adapter_format/names.py)


class TenancyError(Exception):
    """Base class of the errors below."""


class Unauthorized(TenancyError):
    """No API key, a malformed Authorization header, or a key nobody configured (401)."""


class Forbidden(TenancyError):
    """A valid key whose role may not do this (403): a user key on an admin endpoint."""


class TooManyRequests(TenancyError):
    """The tenant already runs its maximum of concurrent requests (429 with `Retry-After`)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # whole seconds, ready for the Retry-After header


class InvalidKeysFile(ValueError):
    """An `--api-keys` file that cannot be read or whose entries are wrong; the message never shows a key."""
