"""A request's structured-output fields -> engine.StructuredOutputsParams, checked before anything is queued.

Three spellings reach the same engine feature: OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` object and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. A request may use one of them. The spec is checked here, on the work pool, against what
the engine will compile (engine/structured_output/budget.py: valid JSON and regex, a schema's depth, size,
enum values and references), so most bad specs are a 400 naming the problem before anything is queued.
Compiling is the engine's: once per spec, on its own threads, while the request waits there; a spec the
compiler refuses, or one past its compile timeout, fails the request with a 400 before its first token.
"""

from __future__ import annotations

from typing import Any

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.budget import StructuredOutputError, check_spec
from loraserve.errors import BadRequest
from loraserve.inference.schemas import ChatCompletionRequest, CompletionRequest
from loraserve.services import Services

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_params(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """What the body asks its output to follow, or None; a 400 for conflicting or incomplete fields."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise BadRequest(
                "response_format of type json_schema: json_schema and its schema must be provided",
                param="response_format",
            )
        asked.append(("response_format", {"json": fmt.json_schema.schema}))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        fields = {"json": so.json, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        fields = {k: v for k, v in fields.items() if v is not None}
        if so.json_object:
            fields["json_object"] = True
        asked.append(("structured_outputs", fields))
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            asked.append((name, {kind: value}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise BadRequest(f"ask for one structured output at a time (got {names})", param=asked[1][0])
    param, fields = asked[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise BadRequest(str(exc), param=param) from None


async def check_structured(services: Services, params: StructuredOutputsParams | None) -> None:
    """The spec's budget and validity, on the work pool: a bad one is the caller's 400 before queueing."""
    if params is None:
        return
    if services.tokenizer is None:
        raise BadRequest("structured outputs need the model's tokenizer, and this model has none")
    try:
        await services.work_pool.run(check_spec, params)
    except StructuredOutputError as exc:
        raise BadRequest(str(exc), param="response_format", code=exc.code) from None
