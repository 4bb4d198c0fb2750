"""Hermes-style calls (Qwen2.5, Qwen3, Hermes and many fine-tunes): `<tool_call>{json}</tool_call>`.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each call is a JSON object with `name` and `arguments` between the tags; calls follow one another, and
the last one may end without its closing tag when the output ends there.
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
    malformed,
    settled_text,
)

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first == -1:
            return Parsed(content=settled_text(text, self.markers, final))
        content = leading_content(text[:first])
        calls: list[PartialCall] = []
        start = first
        while start != -1:
            try:
                node = parse_value(text, start + len(START))
                if node is None:  # nothing but whitespace after the tag yet
                    if final:
                        raise Malformed("an empty <tool_call>")
                    break
                call = call_from_object(node, text)
            except (JsonSyntaxError, Malformed):
                return malformed(text, final, content, calls)
            if call is None:  # the name is still being written
                break
            if not node.complete:
                if final:  # cut off inside the call
                    return malformed(text, final, content, calls)
                calls.append(call)
                break
            after = skip_ws(text, node.end)
            rest = text[after:]
            if not rest.startswith(END) and rest and (final or not END.startswith(rest)):
                return malformed(text, final, content, calls)  # text between the JSON and </tool_call>
            calls.append(call)
            start = text.find(START, after + len(END)) if rest.startswith(END) else -1
        return Parsed(content=content, calls=calls)
