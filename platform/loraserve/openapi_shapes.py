"""What the OpenAPI document cannot learn from the handlers' signatures, added to it before it is served.

- Errors: every operation answers errors with OpenAI's body (loraserve.errors.ErrorBody), never Litestar's
  `{status_code, detail}`; the 4xx responses Litestar infers get that schema, and each operation gains a
  `default` response with it for the other statuses.
- Completions, chat completions and /invocations return a Response or an SSE stream chosen at run time:
  their 200 shows the whole answer (application/json) and the stream's chunks (text/event-stream).
- `POST /v1/adapters` reads its multipart form as it streams in (no Litestar body parameter): its request
  body is described here, so Swagger UI's "Try it out" can upload files.

The handlers stay the one place for paths and summaries; this module only fills in shapes.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

from loraserve.adapters.upload_form import ARCHIVE_FIELD, FILES_FIELD, NAME_FIELD
from loraserve.errors import ErrorBody
from loraserve.inference.schemas import ChatCompletion, ChatCompletionChunk, Completion

_REF = "#/components/schemas/{name}"
_METHODS = ("get", "put", "post", "delete", "patch")
_SSE = (
    'With `"stream": true`: server-sent events, each `data: {chunk}` (the schema), then `data: [DONE]`; '
    'an error after the stream began is one `data: {"error": ...}` event'
)
# path -> (the whole answer, one stream chunk)
_GENERATION = {
    "/v1/completions": (Completion, Completion),
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
}
_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": [NAME_FIELD],
                "properties": {
                    NAME_FIELD: {
                        "type": "string",
                        "description": "the adapter's name (a new version if it exists)",
                    },
                    FILES_FIELD: {
                        "type": "array",
                        "items": {"type": "string", "format": "binary"},
                        "description": "adapter_config.json and adapter_model.safetensors of a PEFT folder",
                    },
                    ARCHIVE_FIELD: {
                        "type": "string",
                        "format": "binary",
                        "description": "or one .tar.gz / .zip of that folder, instead of files",
                    },
                },
            },
            "encoding": {FILES_FIELD: {"contentType": "application/octet-stream"}},
        }
    },
}


def with_openai_shapes(document: dict[str, Any]) -> dict[str, Any]:
    """A copy of Litestar's OpenAPI document with the shapes above filled in."""
    document = copy.deepcopy(document)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    (error_ref, *generation_refs), components = msgspec.json.schema_components(
        [ErrorBody, *(t for pair in _GENERATION.values() for t in pair)], ref_template=_REF
    )
    for name, schema in components.items():
        schemas.setdefault(name, schema)
    error_content = {"application/json": {"schema": error_ref}}
    for item in document.get("paths", {}).values():
        for method in _METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            for status, response in responses.items():
                if status[0] in "45":
                    response["content"] = error_content
            responses["default"] = {"description": "An error: OpenAI's error body", "content": error_content}
    refs = dict(zip(_GENERATION, zip(generation_refs[::2], generation_refs[1::2])))
    for path, (whole, chunk) in refs.items():
        _generation_answer(document, path, whole, chunk)
    _generation_answer(
        document,
        "/invocations",
        {"oneOf": [refs["/v1/chat/completions"][0], refs["/v1/completions"][0]]},
        {"oneOf": [refs["/v1/chat/completions"][1], refs["/v1/completions"][1]]},
    )
    batch = document.get("paths", {}).get("/v1/chat/completions/batch", {}).get("post")
    if batch is not None:
        batch["responses"]["200"] = {
            "description": "One answer, choice i for conversation i",
            "content": {"application/json": {"schema": refs["/v1/chat/completions"][0]}},
        }
    upload = document.get("paths", {}).get("/v1/adapters", {}).get("post")
    if upload is not None:
        upload["requestBody"] = _UPLOAD
    return document


def _generation_answer(document: dict[str, Any], path: str, whole: dict, chunk: dict) -> None:
    operation = document.get("paths", {}).get(path, {}).get("post")
    if operation is None:
        return
    operation["responses"]["200"] = {
        "description": "The answer; with `stream: true` its chunks as server-sent events",
        "content": {
            "application/json": {"schema": whole},
            "text/event-stream": {
                "schema": {**chunk, "description": _SSE}
                if "oneOf" in chunk
                else {"allOf": [chunk], "description": _SSE}
            },
        },
    }
