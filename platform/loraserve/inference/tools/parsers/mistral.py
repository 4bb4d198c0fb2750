"""Mistral calls after the `[TOOL_CALLS]` token, in both of Mistral's layouts:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]      (v0.3 templates)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...                  (tokenizers v11+)

The second may name a call id between the name and its arguments (`[CALL_ID]abc123xyz`), which is
skipped. Mistral's chat templates accept only call ids of 9 letters and digits, so this parser's calls
get such ids.
"""

from __future__ import annotations

import re

from loraserve.inference.tools.json_partial import JsonSyntaxError, canonical, parse_value, skip_ws
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

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    mistral_ids = True

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(TOOL_CALLS)
        if first == -1:
            return Parsed(content=settled_text(text, self.markers, final))
        content = leading_content(text[:first])
        calls: list[PartialCall] = []
        start = skip_ws(text, first + len(TOOL_CALLS))
        try:
            if text.startswith("[", start):
                self._array(text, start, final, calls)
            else:
                self._named(text, start, final, calls)
        except (JsonSyntaxError, Malformed):
            return malformed(text, final, content, calls)
        return Parsed(content=content, calls=calls)

    def _array(self, text: str, start: int, final: bool, calls: list[PartialCall]) -> None:
        node = parse_value(text, start)
        for _, item in node.items:
            call = call_from_object(item, text)
            if call is None:
                break
            calls.append(call)
        if final and not node.complete:
            raise Malformed("the output ends inside the calls")

    def _named(self, text: str, start: int, final: bool, calls: list[PartialCall]) -> None:
        while True:
            name = _NAME.match(text, start).group()
            pos = start + len(name)
            if text.startswith(CALL_ID, pos):
                found = text.find(ARGS, pos)
                if found == -1:
                    if final:
                        raise Malformed("expected [ARGS] after a call id")
                    return  # the call id is still being written
                pos = found
            if not text.startswith(ARGS, pos):
                tail = text[pos:]
                if final or not (ARGS.startswith(tail) or CALL_ID.startswith(tail)):
                    raise Malformed("expected [ARGS] after a call's name")
                return  # the name or its [ARGS] is still being written
            if not name:
                raise Malformed("a call without a name")
            node = parse_value(text, pos + len(ARGS))
            if node is not None and node.kind != "object":
                raise Malformed("a call's arguments must be a JSON object")
            arguments = canonical(node, text) if node is not None else ""
            complete = node is not None and node.complete
            if not complete:
                if final:
                    raise Malformed("the output ends inside a call")
                calls.append(PartialCall(name=name, arguments=arguments, complete=False))
                return
            calls.append(PartialCall(name=name, arguments=arguments, complete=True))
            after = skip_ws(text, node.end)
            if not text.startswith(TOOL_CALLS, after):
                return
            start = skip_ws(text, after + len(TOOL_CALLS))
