"""One exception table: every error the API can raise becomes OpenAI's body with the right status.

    {"error": {"message": "...", "type": "invalid_request_error", "code": "model_not_found"}}

Handlers raise domain errors (tenancy, store, routing, config store, engine) or `APIError`; nothing
builds error responses by hand. Unknown exceptions are logged with their traceback and answered with a
generic 500 that leaks no internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from adapters_store import (
    AdapterNotFound,
    ChecksumError,
    InvalidAdapter,
    StoreUnavailable,
    UploadTooLarge,
)
from adapters_store import InvalidName as StoreInvalidName
from engine import EngineDeadError, RequestError
from loraserve.config_store import ConfigStoreError, ConfigStoreUnavailable
from loraserve.routing import InvalidRoute
from loraserve.tenancy import InvalidName, TenancyError, TooManyRequests

log = logging.getLogger(__name__)


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorDetail


class APIError(Exception):
    """An error the API answers with `status_code`; subclasses fix the status and the type."""

    status_code = 400
    code: str | None = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param


class BadRequest(APIError):
    status_code = 400


class NotFound(APIError):
    status_code = 404
    code = "not_found"


class ServiceUnavailable(APIError):
    status_code = 503
    code = "service_unavailable"


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


# (exception class, status, code); the first matching row wins, so subclasses come before bases.
_DOMAIN_ERRORS: tuple[tuple[type[Exception], int, str], ...] = (
    (UploadTooLarge, 413, "upload_too_large"),
    (InvalidAdapter, 422, "invalid_adapter"),
    (StoreInvalidName, 422, "invalid_name"),
    (InvalidName, 422, "invalid_name"),
    (InvalidRoute, 422, "invalid_route"),
    (AdapterNotFound, 404, "adapter_not_found"),
    (ChecksumError, 503, "adapter_corrupt"),
    (StoreUnavailable, 503, "adapter_store_unavailable"),
    (ConfigStoreUnavailable, 503, "config_store_unavailable"),
    (ConfigStoreError, 500, "config_store_error"),
    (EngineDeadError, 503, "engine_dead"),
    (RequestError, 400, "invalid_request"),
)


def _api_error(_: Request, exc: APIError) -> Response[ErrorBody]:
    return error_response(exc.status_code, str(exc), exc.code, param=exc.param)


def _tenancy_error(_: Request, exc: TenancyError) -> Response[ErrorBody]:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, TooManyRequests) else None
    return error_response(exc.status_code, str(exc), exc.code, headers=headers)


def _http_exception(request: Request, exc: HTTPException) -> Response[ErrorBody]:
    status = exc.status_code
    if isinstance(exc, ValidationException):
        return error_response(400, _validation_message(exc), "invalid_request")
    if status == 404:
        message = f"no such endpoint: {request.method} {request.url.path}; see docs/API.md"
        return error_response(404, message, "not_found")
    if status == 405:
        return error_response(
            405,
            f"{request.method} is not allowed on {request.url.path}",
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
    if status >= 500:
        log.error("internal HTTP error on %s %s: %s", request.method, request.url.path, exc.detail)
        return error_response(status, "internal server error", "internal_error")
    return error_response(status, str(exc.detail), "invalid_request", headers=exc.headers)


# What callers of a 5xx are told: the exception's own text names hosts, buckets or paths (it is logged).
# ChecksumError is absent: it names only the caller's own adapter and what to do.
_PUBLIC_MESSAGES: dict[type[Exception], str] = {
    StoreUnavailable: "the adapter store is unavailable; retry later",
    ConfigStoreUnavailable: "the configuration store is unavailable; retry later",
    ConfigStoreError: "the configuration store holds a record the server cannot read; the server log has the details",
    EngineDeadError: "the engine stopped on an internal error; retry on another replica",
}


def _domain_error(request: Request, exc: Exception) -> Response[ErrorBody]:
    for kind, status, code in _DOMAIN_ERRORS:
        if isinstance(exc, kind):
            message = str(exc)
            if status >= 500:
                log.warning("%s %s failed: %s", request.method, request.url.path, exc)
                message = next((m for k, m in _PUBLIC_MESSAGES.items() if isinstance(exc, k)), message)
            return error_response(
                status, message, getattr(exc, "code", None) or code, param=getattr(exc, "field", None)
            )
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error; the server log has the details", "internal_error")


def _too_deep(request: Request, exc: RecursionError) -> Response[ErrorBody]:
    """msgspec decodes a body nested past the interpreter's recursion limit by raising RecursionError."""
    log.warning("%s %s: body nested too deeply (%s)", request.method, request.url.path, exc)
    return error_response(400, "the request body is nested too deeply to be a valid request", "invalid_json")


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
    APIError: _api_error,
    TenancyError: _tenancy_error,
    HTTPException: _http_exception,
    RecursionError: _too_deep,
    Exception: _domain_error,
}
