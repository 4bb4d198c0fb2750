"""What the adapter store raises on purpose.

Every error carries a stable `code` (for API bodies and metrics) and a message that names the problem
and the fix. The HTTP layer maps them with one table: InvalidName/InvalidAdapter -> 422,
UploadTooLarge -> 413, AdapterNotFound -> 404, ChecksumError and StoreUnavailable -> 503, DiskFull -> 507.
InvalidName (a bad tenant, name, version or reference) is adapter_format's, the one class the store and
the server raise for names; it is not a StoreError.
"""

from __future__ import annotations

from adapter_format.errors import InvalidName  # noqa: F401 (one class for names, adapter_format/names.py)


class StoreError(Exception):
    """Base of the store's errors; `code` names the failed check."""

    code = "store_error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidAdapter(StoreError, ValueError):
    """An upload the engine could not serve, or an unsafe archive; nothing was written.

    `field`: the adapter_config.json key at fault, when one is (the API's `param`).
    """

    code = "invalid_adapter"

    def __init__(self, message: str, code: str | None = None, field: str | None = None):
        super().__init__(message, code)
        self.field = field

    @classmethod
    def from_adapter_error(cls, error: ValueError) -> InvalidAdapter:
        """Wrap adapter_format.errors.AdapterError, keeping its code, message and field."""
        return cls(str(error), getattr(error, "code", cls.code), getattr(error, "field", None))


class UploadTooLarge(StoreError, ValueError):
    """An upload over a size or file-count limit, refused while it streamed in; nothing was written."""

    code = "upload_too_large"


class AdapterNotFound(StoreError, LookupError):
    """No committed adapter (or version) of that name for this tenant."""

    code = "adapter_not_found"


class ChecksumError(StoreError):
    """A downloaded file does not match its manifest: the stored copy is corrupt or was modified."""

    code = "checksum_mismatch"


class StoreUnavailable(StoreError):
    """The backend failed (after retries where retrying could help); `reason` says how."""

    code = "store_unavailable"

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


class DiskFull(StoreError):
    """A local disk (the upload staging folder, the disk cache, a local store) has no room left, even after
    the disk cache evicted what it could; nothing half-written is left behind. Retrying later may work."""

    code = "insufficient_storage"
