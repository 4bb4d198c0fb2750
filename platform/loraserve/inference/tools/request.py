"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls` -> a ToolPlan, with vLLM's 400s.

Semantics (OpenAI's, as vLLM implements them): `tool_choice` defaults to "auto" when tools are given and
to "none" otherwise; "none" renders the tools into the prompt but never parses calls; "auto" parses the
output with the tool-call parser (the adapter's own, else the server's `--tool-call-parser` under
`--enable-auto-tool-choice`, else a 400); a named function or "required" constrains decoding to calls
(tools/grammar.py), so their arguments always fit the schemas.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from engine.structured_output import StructuredOutputsParams
from loraserve.errors import BadRequest
from loraserve.inference.tools.forced import NamedCallParser, RequiredCallsParser
from loraserve.inference.tools.grammar import named_schema, required_schema
from loraserve.inference.tools.output import ToolOutput
from loraserve.inference.tools.parsers import get_parser
from loraserve.inference.tools.rendering import template_tools
from loraserve.inference.tools.types import ToolDefinition

Mode = Literal["none", "auto", "named", "required"]
_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
AUTO_NEEDS_PARSER = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: list[ToolDefinition]
    function_name: str | None = None  # the named function
    parallel_tool_calls: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (vLLM renders them under "none" too)."""
        return template_tools(self.tools) if self.tools else None

    def constrain(self, params: Any) -> Any:
        """SamplingParams with the grammar of a named or "required" choice."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.function_name)
            schema = named_schema(tool)
        elif self.mode == "required":
            schema = required_schema(self.tools, self.parallel_tool_calls)
        else:
            return params
        try:
            grammar = StructuredOutputsParams(json=schema)
        except ValueError as exc:  # e.g. schemas too large to compile
            raise BadRequest(f"the tools' parameters schemas cannot be used: {exc}", param="tools") from None
        return dataclasses.replace(params, structured_outputs=grammar)

    def output(self, auto_parser: str | None) -> ToolOutput | None:
        """How to read the output into calls; `auto_parser` is the adapter's or the server's parser name."""
        if self.mode == "named":
            return ToolOutput(NamedCallParser(self.function_name or ""))
        if self.mode == "required":
            return ToolOutput(RequiredCallsParser())
        if self.mode == "auto":
            if auto_parser is None:
                raise BadRequest(AUTO_NEEDS_PARSER, param="tool_choice")
            return ToolOutput(get_parser(auto_parser), single_call=not self.parallel_tool_calls)
        return None


def plan_tools(body: Any) -> ToolPlan | None:
    """The request's tool use, checked; None when it has none (no tools, and no tool_choice but "none")."""
    tools, choice = body.tools, body.tool_choice
    if tools is not None and not tools:
        raise BadRequest("`tools` must not be an empty array; leave it out instead", param="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none", tools) if tools else None
    if tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, dict):
        name = _named_function(choice, tools)
        _refuse_structured_outputs(body)
        return ToolPlan("named", tools, function_name=name, parallel_tool_calls=parallel)
    if choice not in ("auto", "required"):
        raise BadRequest(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
            '"required" are supported.',
            param="tool_choice",
        )
    if choice == "required":
        _refuse_structured_outputs(body)
    return ToolPlan(choice, tools, parallel_tool_calls=parallel)


def _named_function(choice: dict[str, Any], tools: list[ToolDefinition]) -> str:
    if choice.get("type", "function") != "function":
        raise BadRequest(
            f"Invalid `type` in `tool_choice`: `{choice.get('type')}`! {_CORRECT_USAGE}", param="tool_choice"
        )
    function = choice.get("function")
    if not isinstance(function, dict):
        raise BadRequest(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}",
            param="tool_choice",
        )
    if "name" not in function:
        raise BadRequest(
            f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}", param="tool_choice"
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise BadRequest(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
            param="tool_choice",
        )
    if not any(tool.function.name == name for tool in tools):
        raise BadRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    return name


def _refuse_structured_outputs(body: Any) -> None:
    """A forced call brings its own grammar; a second constraint cannot hold at the same time."""
    fmt = body.response_format
    asked = [name for name in _STRUCTURED_FIELDS if getattr(body, name) is not None]
    if fmt is not None and fmt.type != "text":
        asked.insert(0, "response_format")
    if asked:
        raise BadRequest(
            "You can only either use constraints for structured outputs or tools, not both.",
            param=asked[0],
        )
