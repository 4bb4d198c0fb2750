"""Calls whose shape the grammar forced (tool_choice named or "required"), read from the output text.

Named: the whole output is the arguments object of the named function (grammar: its parameters
schema). "required": the output is vLLM's array of one or more `{"name": ..., "parameters": {...}}`
(grammar: tools/grammar.py). Arguments are written as canonical JSON (json_partial.py): what xgrammar
lets through but JSON forbids (raw control characters in strings) comes out escaped. Output cut short by
max_tokens: a named call keeps the arguments written so far (as vLLM); a "required" array that does not
parse is returned as text.
"""

from __future__ import annotations

from loraserve.inference.tools.json_partial import JsonSyntaxError, canonical, parse_value
from loraserve.inference.tools.parsers.base import (
    Malformed,
    Parsed,
    PartialCall,
    ToolParser,
    call_from_object,
    malformed,
)


class NamedCallParser(ToolParser):
    """tool_choice `{"type": "function", "function": {"name": NAME}}`: one call of NAME."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            node = parse_value(text)
            arguments = canonical(node, text) if node is not None else ""
        except JsonSyntaxError:  # not JSON at all (no grammar held it): the text as it is
            arguments = text
        return Parsed(content="", calls=[PartialCall(self.function_name, arguments, final)])


class RequiredCallsParser(ToolParser):
    """tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`."""

    def parse(self, text: str, final: bool) -> Parsed:
        calls: list[PartialCall] = []
        try:
            node = parse_value(text)
            if node is None or node.kind != "array":
                if node is None and not final:
                    return Parsed(content="")
                raise Malformed("expected an array of calls")
            for _, item in node.items:
                call = call_from_object(item, text)
                if call is None:
                    break
                calls.append(call)
            if final and not (node.complete and calls and all(c.complete for c in calls)):
                raise Malformed("the array of calls is incomplete")
        except (JsonSyntaxError, Malformed):
            return malformed(text, final, "", [] if final else calls)
        return Parsed(content="", calls=calls)
