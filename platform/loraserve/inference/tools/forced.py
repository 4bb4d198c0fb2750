"""Calls whose shape the grammar forced (tool_choice named or "required"), read from the output text.

Named: the whole output is the arguments object of the named function (grammar: its parameters
schema), sent as written, as vLLM does. "required": the output is vLLM's array of one or more
`{"name": ..., "parameters": {...}}` (grammar: tools/grammar.py), the calls' arguments written as
canonical JSON. Output cut short by max_tokens still parses as far as it goes while streaming; whole, a
"required" array that does not parse is returned as text.
"""

from __future__ import annotations

from loraserve.inference.tools.json_partial import JsonSyntaxError, parse_value
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
        return Parsed(content="", calls=[PartialCall(self.function_name, text, final)])


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
