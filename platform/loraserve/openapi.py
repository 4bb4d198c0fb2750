"""The browsable API schema: Litestar's OpenAPI document and its UIs, served without authentication.

    GET /schema                 Swagger UI (try requests from the browser; "Authorize" takes an API key)
    GET /schema/redoc           ReDoc, for reading
    GET /schema/openapi.json    the OpenAPI 3.1 document (also /schema/openapi.yaml)

The document is built from the handlers' signatures, tags and summaries only, so it holds no tenant data
whoever asks; docs/API.md and docs/API_ADMIN.md list the same paths (tests/platform/test_openapi.py).
"""

from __future__ import annotations

from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    RedocRenderPlugin,
    SwaggerRenderPlugin,
    YamlRenderPlugin,
)
from litestar.openapi.spec import Components, SecurityScheme, Tag

SCHEMA_PATH = "/schema"
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
            SwaggerRenderPlugin(path="/"),
            RedocRenderPlugin(),
            JsonRenderPlugin(),
            YamlRenderPlugin(),
        ],
    )
