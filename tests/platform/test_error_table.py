"""Each exception the API expects becomes one OpenAI error body with a fixed status, type and code.

Pins the answers of the whole family, whichever module raises them, so the one table in
loraserve/errors.py can change shape without any client seeing a difference.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from loraserve.adapters.runtime_loading import RuntimeLoadingDisabled
from loraserve.app import create_app  # noqa: F401 (imports every module that defines an API error)
from loraserve.config_store import ConfigStoreError, ConfigStoreUnavailable
from loraserve.errors import (
    ERROR_TABLE,
    EXCEPTION_HANDLERS,
    APIError,
    BadRequest,
    NotFound,
    ServiceUnavailable,
)
from loraserve.inference.generation import GenerationFailed
from loraserve.name_conflicts import AdapterInUse, NameConflict
from loraserve.resolution import ModelNotFound
from loraserve.routes import RouteNotFound
from loraserve.routing import InvalidRoute
from loraserve.tenancy import Forbidden, InvalidName, TenancyError, TooManyRequests, Unauthorized

from adapters_store import AdapterNotFound, ChecksumError, InvalidAdapter, StoreUnavailable, UploadTooLarge
from engine import EngineDeadError, RequestError

REQUEST = SimpleNamespace(method="POST", url=SimpleNamespace(path="/v1/x"))

CASES = [
    # (exception, status, type, code, param)
    (BadRequest("m"), 400, "invalid_request_error", "invalid_request", None),
    (
        BadRequest("m", code="no_chat_template", param="messages"),
        400,
        "invalid_request_error",
        "no_chat_template",
        "messages",
    ),
    (NotFound("m"), 404, "not_found_error", "not_found", None),
    (ModelNotFound("m"), 404, "not_found_error", "model_not_found", None),
    (RouteNotFound("r"), 404, "not_found_error", "route_not_found", None),
    (ServiceUnavailable("m"), 503, "service_unavailable", "service_unavailable", None),
    (
        ServiceUnavailable("m", code="server_shutting_down"),
        503,
        "service_unavailable",
        "server_shutting_down",
        None,
    ),
    (GenerationFailed("m"), 503, "service_unavailable", "generation_failed", None),
    (Unauthorized("m"), 401, "authentication_error", "invalid_api_key", None),
    (Forbidden("m"), 403, "permission_error", "insufficient_permissions", None),
    (TooManyRequests("m", retry_after_s=3), 429, "rate_limit_error", "rate_limit_exceeded", None),
    (UploadTooLarge("m"), 413, "invalid_request_error", "upload_too_large", None),
    (InvalidAdapter("m", "rank_too_large"), 422, "invalid_request_error", "rank_too_large", None),
    (InvalidName("m"), 422, "invalid_request_error", "invalid_name", None),
    (
        InvalidRoute("m", field="variants[1].weight"),
        422,
        "invalid_request_error",
        "invalid_route",
        "variants[1].weight",
    ),
    (AdapterNotFound("m"), 404, "not_found_error", AdapterNotFound.code, None),
    (ChecksumError("m"), 503, "service_unavailable", ChecksumError.code, None),
    (StoreUnavailable("m"), 503, "service_unavailable", StoreUnavailable.code, None),
    (ConfigStoreUnavailable("m"), 503, "service_unavailable", "config_store_unavailable", None),
    (ConfigStoreError("m"), 500, "server_error", "config_store_error", None),
    (EngineDeadError("m"), 503, "service_unavailable", "engine_dead", None),
    (NameConflict("m", param="name"), 409, "invalid_request_error", "name_conflict", "name"),
    (AdapterInUse("m"), 409, "invalid_request_error", "adapter_in_use", None),
    (RuntimeLoadingDisabled("m"), 403, "permission_error", "runtime_lora_loading_disabled", None),
    (RequestError("m"), 400, "invalid_request_error", "invalid_request", None),
]


def answer(exc: Exception):
    """The app's response to `exc`, found the way Litestar finds a handler (the closest class in the MRO)."""
    handler = next(EXCEPTION_HANDLERS[kind] for kind in type(exc).__mro__ if kind in EXCEPTION_HANDLERS)
    response = handler(REQUEST, exc)
    return response.status_code, json.loads(response.to_asgi_response(None, None).body), response.headers


@pytest.mark.parametrize("exc, status, kind, code, param", CASES, ids=lambda v: type(v).__name__)
def test_each_expected_exception_has_one_answer(exc, status, kind, code, param):
    got_status, body, headers = answer(exc)
    assert got_status == status
    # 5xx of the stores and the engine tell a fixed text (theirs names hosts and paths); the rest their own.
    message = (
        str(exc) if status < 500 or isinstance(exc, (APIError, ChecksumError)) else body["error"]["message"]
    )
    assert message != "m" or status < 500 or isinstance(exc, (APIError, ChecksumError))
    assert body == {"error": {"message": message, "type": kind, "code": code, "param": param}}
    assert ("Retry-After" in headers) == isinstance(exc, TooManyRequests)


def test_retry_after_carries_the_limiters_seconds():
    assert answer(TooManyRequests("busy", retry_after_s=7))[2]["Retry-After"] == "7"


def test_anything_else_is_a_500_that_says_nothing_of_it():
    status, body, _ = answer(ValueError("/secret/path"))
    assert status == 500
    assert body["error"]["code"] == "internal_error" and "/secret/path" not in json.dumps(body)


def _subclasses(base: type) -> list[type]:
    return [base] + [c for sub in base.__subclasses__() for c in _subclasses(sub)]


def test_statuses_live_only_in_the_table():
    """No API error class sets its own status: ERROR_TABLE is the one place (a new status needs a row);
    tenancy's errors know nothing of HTTP (status_and_code answers for them)."""
    own = [
        c.__qualname__ for c in _subclasses(APIError) + _subclasses(TenancyError) if "status_code" in vars(c)
    ]
    assert own == ["APIError"]  # the read-only property that looks the status up
    kinds = [row.kind for row in ERROR_TABLE]
    for i, kind in enumerate(kinds):  # a base listed before its subclass would shadow the subclass's row
        assert not any(issubclass(later, kind) for later in kinds[i + 1 :]), kind
