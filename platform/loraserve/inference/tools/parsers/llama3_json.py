"""Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several separated by `;`.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The calls may follow some text and may be preceded by `<|python_tag|>`; `arguments` is read like
`parameters`. A `{` that does not start a call is text, and the search goes on after it.
"""

from __future__ import annotations

from loraserve.inference.tools.json_partial import JsonSyntaxError, parse_value, skip_ws
from loraserve.inference.tools.parsers.base import (
    Malformed,
    Parsed,
    PartialCall,
    ToolParser,
    call_from_object,
    leading_content,
    settled_text,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("{", PYTHON_TAG)

    def parse(self, text: str, final: bool) -> Parsed:
        search = 0
        while (brace := text.find("{", search)) != -1:
            before = text[:brace].rstrip()
            if before.endswith(PYTHON_TAG):
                before = before[: -len(PYTHON_TAG)]
            content = leading_content(before)
            calls: list[PartialCall] = []
            start = brace
            try:
                while True:
                    node = parse_value(text, start)
                    call = call_from_object(node, text) if node is not None else None
                    if call is None:  # more text may follow (an object without a name raised Malformed)
                        if final:
                            raise Malformed("the output ends inside a call")
                        return Parsed(content=content, calls=calls)
                    if not node.complete:
                        if final:
                            raise Malformed("the output ends inside a call")
                        return Parsed(content=content, calls=[*calls, call])
                    calls.append(call)
                    after = skip_ws(text, node.end)
                    if after >= len(text) or text[after] != ";":
                        return Parsed(content=content, calls=calls)  # text after the calls is dropped
                    start = after + 1
            except (JsonSyntaxError, Malformed) as exc:
                if calls:
                    return Parsed(content=content, calls=calls)
                # Not a call: this brace is text; look for a call after the part that was read.
                search = max(brace + 1, getattr(exc, "pos", brace + 1))
        return Parsed(content=settled_text(text, (PYTHON_TAG,), final))
