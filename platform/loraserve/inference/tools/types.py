"""OpenAI's tool-calling shapes: the request's `tools`, messages' `tool_calls`, and the response's calls.

Request structs ignore unknown fields (as the other request bodies do); `tool_choice` stays raw in the
request (str or object) so that tools/request.py can answer a bad one with vLLM's wording.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# OpenAI allows [A-Za-z0-9_-]{1,64}; vLLM checks nothing, so names any client sends to vLLM work here too.
FunctionName = Annotated[str, Meta(min_length=1, max_length=256)]


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # OpenAI's; arguments always follow the schema under named and "required"


class ToolDefinition(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    # A JSON object as text (OpenAI's); an object is accepted too, as vLLM does
    arguments: str | dict[str, Any] | None = None


class MessageToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


# ---- responses --------------------------------------------------------------------------------------


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str  # a JSON object as text


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A stream's piece of call `index`: the first carries id, type and name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
