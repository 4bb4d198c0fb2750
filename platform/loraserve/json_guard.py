"""Endpoints that take a JSON body refuse any other Content-Type, as vLLM does (a 400 naming the fix)."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from loraserve.errors import BadRequest


def require_json_body(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard: `Content-Type: application/json` (any parameters, e.g. charset) or a 400."""
    if connection.scope.get("method") != "POST":
        return
    media_type = connection.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise BadRequest(
            "Unsupported Media Type: only 'application/json' is allowed; send the body with "
            "Content-Type: application/json",
            code="unsupported_media_type",
        )
