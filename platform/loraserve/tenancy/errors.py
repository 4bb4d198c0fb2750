"""Errors of authentication, authorization and per-tenant limits.

The HTTP status and error code of each are in the app's one exception table (loraserve/errors.py).
"""

from __future__ import annotations


class TenancyError(Exception):
    """Base class of the errors below."""

    @property
    def status_code(self) -> int:
        """The HTTP status the app's exception table gives this error."""
        from loraserve.errors import status_and_code  # late: loraserve.errors imports this module

        mapped = status_and_code(self)
        assert mapped is not None  # the table has a row for TenancyError itself
        return mapped[0]


class Unauthorized(TenancyError):
    """No API key, a malformed Authorization header, or a key nobody configured (401)."""


class Forbidden(TenancyError):
    """A valid key whose role may not do this (403): a user key on an admin endpoint."""


class TooManyRequests(TenancyError):
    """The tenant already runs its maximum of concurrent requests (429 with `Retry-After`)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # whole seconds, ready for the Retry-After header


class InvalidName(ValueError):
    """A tenant, adapter or route name outside the safe syntax (the API answers 422)."""


class InvalidKeysFile(ValueError):
    """An `--api-keys` file that cannot be read or whose entries are wrong; the message never shows a key."""
