"""The browsable API schema: Litestar's OpenAPI document and its UIs, served without authentication.

    GET /schema                 Swagger UI (try requests from the browser; "Authorize" takes an API key)
    GET /schema/swagger         the same
    GET /schema/redoc           ReDoc, for reading
    GET /schema/openapi.json    the OpenAPI 3.1 document (also /schema/openapi.yaml)
    GET /schema/assets/...      the UIs' scripts and styles

The document is built from the handlers' signatures, tags and summaries only, so it holds no tenant data
whoever asks; docs/API.md and docs/API_ADMIN.md list the same paths (tests/platform/test_openapi.py).

The UIs' scripts are served from this package (openapi_ui/, with their licences: Swagger UI is
Apache-2.0, ReDoc MIT), never from a CDN, so the pages work on a machine without internet access. Their
URLs carry the request's root path, so they also load behind a proxy that strips `--root-path`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, Router
from litestar.datastructures import CacheControlHeader
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    RedocRenderPlugin,
    SwaggerRenderPlugin,
    YamlRenderPlugin,
)
from litestar.openapi.spec import Components, SecurityScheme, Tag
from litestar.static_files import create_static_files_router

SCHEMA_PATH = "/schema"
ASSETS_DIR = Path(__file__).parent / "openapi_ui"
ASSETS_PATH = "/assets"  # under SCHEMA_PATH
# Stands for "<root path>/schema/assets" in the pages until a request says what the root path is.
_ASSETS = "__loraserve_openapi_assets__"
_NO_FAVICON = "<link rel='icon' href='data:,'>"  # no request for one (Litestar's default is on a CDN)
# The pages may load nothing from elsewhere: ReDoc's side menu shows Redocly's logo from their CDN, which
# this blocks before any request is made (the image then hides itself). Inline scripts start the UIs;
# ReDoc compiles JSON schemas with `new Function` and searches in a worker made from a blob.
_ONLY_THIS_SERVER = (
    "<meta http-equiv='Content-Security-Policy' content=\"default-src 'self'; "
    "script-src 'self' 'unsafe-inline' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'\">"
)
# The name of the `Authorization: Bearer KEY` scheme that the tenant-facing controllers declare.
BEARER = "bearer"
BEARER_SECURITY: list[dict[str, list[str]]] = [{BEARER: []}]

_TAGS = [
    Tag(name="inference", description="OpenAI-compatible completions, chat completions and the model list"),
    Tag(
        name="adapters", description="Upload, list and delete the tenant's LoRA adapters (writes need admin)"
    ),
    Tag(
        name="routes",
        description="A/B routes that split a tenant's traffic between adapters (writes need admin)",
    ),
    Tag(name="tokenizer", description="vLLM's tokenize and detokenize, with the served model's tokenizer"),
    Tag(name="usage", description="The tenant's own token usage and fair share"),
    Tag(name="ops", description="Probes and Prometheus metrics; no authentication"),
]


def openapi_config(version: str) -> OpenAPIConfig:
    return OpenAPIConfig(
        title="loraserve",
        version=version,
        description=(
            "Multi-LoRA serving with OpenAI's API. Send `Authorization: Bearer KEY` (any key in open mode). "
            "The request `model` is the base model, an adapter (`name` or `name@version`) or an A/B route."
        ),
        path=SCHEMA_PATH,
        tags=_TAGS,
        components=Components(
            security_schemes={
                BEARER: SecurityScheme(type="http", scheme="bearer", description="an API key (`sk-...`)")
            }
        ),
        render_plugins=[
            LocalSwaggerUI(
                path=["/", "/swagger"],
                js_url=f"{_ASSETS}/swagger-ui-bundle.js",
                css_url=f"{_ASSETS}/swagger-ui.css",
                standalone_preset_js_url=f"{_ASSETS}/swagger-ui-standalone-preset.js",
                favicon=_NO_FAVICON,
            ),
            LocalRedoc(js_url=f"{_ASSETS}/redoc.standalone.js", google_fonts=False, favicon=_NO_FAVICON),
            JsonRenderPlugin(),
            YamlRenderPlugin(),
        ],
    )


def _with_local_assets(page: bytes, request: Request) -> bytes:
    prefix = request.scope.get("root_path", "") + SCHEMA_PATH + ASSETS_PATH
    page = page.replace(b"<head>", b"<head>" + _ONLY_THIS_SERVER.encode(), 1)
    return page.replace(_ASSETS.encode(), prefix.encode())


class LocalSwaggerUI(SwaggerRenderPlugin):
    """Swagger UI from this package's assets, which it serves under /schema/assets."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return _with_local_assets(super().render(request, openapi_schema), request)

    def receive_router(self, router: Router) -> None:
        super().receive_router(router)
        router.register(
            create_static_files_router(
                path=ASSETS_PATH,
                directories=[ASSETS_DIR],
                name="openapi-ui-assets",
                include_in_schema=False,
                cache_control=CacheControlHeader(max_age=3600),
            )
        )


class LocalRedoc(RedocRenderPlugin):
    """ReDoc from this package's assets (served by LocalSwaggerUI's route)."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return _with_local_assets(super().render(request, openapi_schema), request)
