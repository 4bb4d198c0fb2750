"""JSON schemas that force calls (tool_choice named or "required"), for xgrammar (engine.structured_output).

Named: the function's parameters schema itself; the output is the arguments object. "required" (vLLM's
shape): an array of one or more `{"name": NAME, "parameters": ARGS}` objects, each NAME one of the
tools' with its own parameters schema, at most one item when parallel_tool_calls is false. The tools'
`$defs` (and draft-07 `definitions`) move to the array schema's root, where their `#/$defs/...`
references point once the schemas are nested.
"""

from __future__ import annotations

import copy
from typing import Any

from loraserve.errors import BadRequest
from loraserve.inference.tools.types import FunctionDefinition, ToolDefinition

_DEFINITIONS = ("$defs", "definitions")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(function: FunctionDefinition) -> dict[str, Any]:
    """The arguments' schema; a function without parameters takes an empty object."""
    schema = function.parameters
    if not schema:
        return dict(NO_PARAMETERS)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise BadRequest(
            f"the parameters of function {function.name!r} must be a JSON schema of an object "
            f"(got type {kind!r})",
            param="tools",
        )
    return schema


def named_schema(tool: ToolDefinition) -> dict[str, Any]:
    return parameters_schema(tool.function)


def required_schema(tools: list[ToolDefinition], parallel_tool_calls: bool) -> dict[str, Any]:
    definitions: dict[str, dict[str, Any]] = {key: {} for key in _DEFINITIONS}
    choices = []
    for tool in tools:
        parameters = copy.deepcopy(parameters_schema(tool.function))
        for key in _DEFINITIONS:
            for name, schema in (parameters.pop(key, None) or {}).items():
                if definitions[key].get(name, schema) != schema:
                    raise BadRequest(
                        f"two tools define {key}/{name} differently; give the definitions distinct names",
                        param="tools",
                    )
                definitions[key][name] = schema
        choices.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update({key: value for key, value in definitions.items() if value})
    return schema
