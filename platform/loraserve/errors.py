"""One exception table: every error the API can raise becomes OpenAI's body with the right status.

    {"error": {"message": "...", "type": "invalid_request_error", "code": "model_not_found"}}

Handlers raise domain errors (tenancy, store, routing, config store, engine) or `APIError`; nothing
builds error responses by hand. ERROR_TABLE is the one place that gives each exception class its HTTP
status and default `code`; `type` follows from the status (`error_type`); an exception that carries a
more specific `code` of its own (the store's errors, `ModelNotFound`, `APIError(..., code=...)`) keeps
it. Unknown exceptions are logged with their traceback and answered with a generic 500 that leaks no
internals. Litestar's own HTTP exceptions (bad JSON, unknown path, wrong method) have their handler.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from adapters_store import (
    AdapterNotFound,
    ChecksumError,
    DiskFull,
    InvalidAdapter,
    StoreUnavailable,
    UploadTooLarge,
)
from engine import EngineDeadError, RequestError
from loraserve.config_store import ConfigStoreError, ConfigStoreUnavailable
from loraserve.routing import InvalidRoute
from loraserve.tenancy import Forbidden, InvalidName, TenancyError, TooManyRequests, Unauthorized

log = logging.getLogger(__name__)
_CLIENT_GONE = "client disconnected prematurely"  # Litestar's detail when the body stops arriving


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorDetail


class APIError(Exception):
    """An error the handlers raise on purpose; ERROR_TABLE gives its status by class.

    `code` (a subclass's, or this instance's) overrides the table's default code; `param` names the field.
    """

    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param

    @property
    def status_code(self) -> int:
        """The HTTP status ERROR_TABLE gives this error (read-only: the table is the one place for it)."""
        mapped = status_and_code(self)
        assert mapped is not None  # the table has a row for APIError itself
        return mapped[0]


class BadRequest(APIError):
    """400."""


class NotFound(APIError):
    """404, as for anything another tenant owns."""


class PermissionDenied(APIError):
    """403 for a refusal that is not about the caller's role (tenancy's Forbidden is)."""


class Conflict(APIError):
    """409: the request clashes with what exists (a name taken, a version still in use)."""


class ServiceUnavailable(APIError):
    """503: retry later or elsewhere."""


def error_type(status: int) -> str:
    """OpenAI's `type` for a status: what kind of problem, independent of the specific `code`."""
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_response(
    status: int,
    message: str,
    code: str | None,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response[ErrorBody]:
    detail = ErrorDetail(message=message, type=error_type(status), code=code, param=param)
    return Response(ErrorBody(error=detail), status_code=status, media_type=MediaType.JSON, headers=headers)


def error_event(status: int, message: str, code: str | None) -> bytes:
    """The same body as one server-sent event, for errors that happen after a stream has started."""
    detail = ErrorDetail(message=message, type=error_type(status), code=code)
    return b"data: " + msgspec.json.encode(ErrorBody(error=detail)) + b"\n\n"


class ErrorRow(NamedTuple):
    kind: type[Exception]
    status: int
    code: str  # the default; an exception with a `code` of its own keeps it
    # What callers are told instead of the exception's text, which for these 5xx names hosts, buckets or
    # paths (it is logged). None: the exception's own message, written for the caller.
    public_message: str | None = None


# The first matching row wins, so subclasses come before bases.
ERROR_TABLE: tuple[ErrorRow, ...] = tuple(
    ErrorRow(*row)
    for row in (
        # Raised by the handlers themselves.
        (NotFound, 404, "not_found"),
        (PermissionDenied, 403, "permission_denied"),
        (Conflict, 409, "conflict"),
        (ServiceUnavailable, 503, "service_unavailable"),
        (APIError, 400, "invalid_request"),
        # Authentication, roles and per-tenant limits.
        (Unauthorized, 401, "invalid_api_key"),
        (Forbidden, 403, "insufficient_permissions"),
        (TooManyRequests, 429, "rate_limit_exceeded"),
        (TenancyError, 400, "invalid_request"),
        # The adapter store, names, routes, the config store and the engine.
        (UploadTooLarge, 413, "upload_too_large"),
        (InvalidAdapter, 422, "invalid_adapter"),
        (InvalidName, 422, "invalid_name"),  # one class for the store's and the server's names
        (InvalidRoute, 422, "invalid_route"),
        (AdapterNotFound, 404, "adapter_not_found"),
        (ChecksumError, 503, "adapter_corrupt"),  # its text names only the caller's adapter and what to do
        (DiskFull, 507, "insufficient_storage"),  # its text names no path: the disk is full, retry later
        (StoreUnavailable, 503, "adapter_store_unavailable", "the adapter store is unavailable; retry later"),
        (
            ConfigStoreUnavailable,
            503,
            "config_store_unavailable",
            "the configuration store is unavailable; retry later",
        ),
        (
            ConfigStoreError,
            500,
            "config_store_error",
            "the configuration store holds a record the server cannot read; the server log has the details",
        ),
        (
            EngineDeadError,
            503,
            "engine_dead",
            "the engine stopped on an internal error; retry on another replica",
        ),
        (RequestError, 400, "invalid_request"),
    )
)


def _row(exc: Exception) -> ErrorRow | None:
    return next((row for row in ERROR_TABLE if isinstance(exc, row.kind)), None)


def status_and_code(exc: Exception) -> tuple[int, str | None] | None:
    """ERROR_TABLE's answer for `exc`: (status, code), or None for an exception the API does not expect."""
    row = _row(exc)
    return None if row is None else (row.status, getattr(exc, "code", None) or row.code)


def public_message(exc: Exception) -> str:
    """The message callers see for `exc`: its own text unless its row says otherwise."""
    row = _row(exc)
    return row.public_message if row is not None and row.public_message else str(exc)


def _sent_path(request: Request) -> str:
    """The path as the client sent it. Under --root-path, uvicorn's scope `path` already starts with the
    root path (the ASGI rule) and Litestar's URL adds it again; servers that follow the older rule leave it
    out of `path`. Either way the prefix is named once."""
    root, path = request.scope.get("root_path", ""), request.scope["path"]
    return path if not root or path.startswith(root) else root + path


def _http_exception(request: Request, exc: HTTPException) -> Response[ErrorBody]:
    status = exc.status_code
    if isinstance(exc, ValidationException):
        return error_response(400, _validation_message(exc), "invalid_request")
    if status == 404:
        message = f"no such endpoint: {request.method} {_sent_path(request)}; see docs/API.md"
        return error_response(404, message, "not_found")
    if status == 405:
        return error_response(
            405,
            f"{request.method} is not allowed on {_sent_path(request)}",
            "method_not_allowed",
            headers=_allow_header(exc),
        )
    if status == 413:
        limit = (
            request.route_handler.resolve_request_max_body_size()
            if request.scope.get("route_handler")
            else None
        )
        hint = f" (the limit is {limit} bytes)" if limit else ""
        return error_response(413, f"request body too large{hint}", "request_too_large")
    if status == 400 and isinstance(exc.__cause__, SerializationException):
        return error_response(400, f"the request body is not valid JSON: {exc.detail}", "invalid_json")
    if (
        status == 500 and exc.detail == _CLIENT_GONE
    ):  # the client left (or timed out) mid-body: nobody reads this
        log.info("%s %s: the client left before its body arrived", request.method, request.url.path)
        return error_response(
            400, "the client disconnected before its request body arrived", "client_disconnected"
        )
    if status >= 500:
        log.error("internal HTTP error on %s %s: %s", request.method, request.url.path, exc.detail)
        return error_response(status, "internal server error", "internal_error")
    return error_response(status, str(exc.detail), "invalid_request", headers=exc.headers)


def _domain_error(request: Request, exc: Exception) -> Response[ErrorBody]:
    mapped = status_and_code(exc)
    if mapped is None:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error; the server log has the details", "internal_error")
    status, code = mapped
    if status >= 500 and not isinstance(exc, APIError):  # the handlers' own 503s are expected answers
        log.warning("%s %s failed: %s", request.method, request.url.path, exc)
    param = getattr(exc, "param", None) or getattr(exc, "field", None)  # InvalidRoute names its field
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, TooManyRequests) else None
    return error_response(status, public_message(exc), code, param=param, headers=headers)


def _undecodable_body(request: Request, exc: RecursionError | UnicodeDecodeError) -> Response[ErrorBody]:
    """msgspec decodes a body nested past the interpreter's recursion limit by raising RecursionError, and
    one with invalid UTF-8 in a string by raising UnicodeDecodeError (not its DecodeError, which Litestar
    answers itself); both are the caller's 400. Raised anywhere else, they are server bugs: the generic 500."""
    if not _raised_decoding_the_body(exc):
        return _domain_error(request, exc)
    log.warning("%s %s: undecodable body (%s)", request.method, request.url.path, exc)
    if isinstance(exc, UnicodeDecodeError):
        return error_response(400, "the request body is not valid UTF-8 JSON", "invalid_json")
    return error_response(400, "the request body is nested too deeply to be a valid request", "invalid_json")


def _raised_decoding_the_body(exc: BaseException) -> bool:
    """Whether the innermost frames are the request body's JSON decoding (Litestar's msgspec hooks)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and any(f.name == "decode_json" for f in frames[-3:])


def _validation_message(exc: ValidationException) -> str:
    """Litestar's detail plus msgspec's precise reason (e.g. 'Expected `int` >= 1 - at `$.max_tokens`')."""
    extra: Any = exc.extra
    reasons = []
    if isinstance(extra, list):
        for item in extra:
            if isinstance(item, dict) and item.get("message"):
                where = item.get("key")
                reasons.append(
                    f"{item['message']}"
                    + (f" (field {where})" if where and where not in str(item["message"]) else "")
                )
    detail = str(exc.detail) if exc.detail else "invalid request"
    if detail.startswith("Validation failed for"):
        detail = "invalid request body"
    return detail + (": " + "; ".join(reasons) if reasons else "")


def _allow_header(exc: HTTPException) -> dict[str, str] | None:
    allow = (exc.headers or {}).get("Allow") if exc.headers else None
    return {"Allow": allow} if allow else None


EXCEPTION_HANDLERS: dict[type[Exception], Callable[..., Response[Any]]] = {
    HTTPException: _http_exception,
    RecursionError: _undecodable_body,
    UnicodeDecodeError: _undecodable_body,
    Exception: _domain_error,  # everything ERROR_TABLE knows, and the generic 500
}
