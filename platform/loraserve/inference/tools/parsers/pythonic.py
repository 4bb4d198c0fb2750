"""Pythonic calls (Llama 3.2 / 4 pythonic templates, ToolACE): the output is a Python list of calls.

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

Arguments are keyword arguments with Python literal values (strings, numbers, True/False/None, lists,
dicts), read with `ast.literal_eval` (never evaluated) and written as JSON. The list must open the
output (after `<|python_start|>`, which Llama 4 may write); anything else is plain text.
"""

from __future__ import annotations

import ast
import json
import re

from loraserve.inference.tools.json_partial import skip_ws
from loraserve.inference.tools.parsers.base import (
    Malformed,
    Parsed,
    PartialCall,
    ToolParser,
    malformed,
    settled_text,
)

PYTHON_START = "<|python_start|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPEN, _CLOSE = "([{", ")]}"


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("[", PYTHON_START)

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_START, start):
            start = skip_ws(text, start + len(PYTHON_START))
            if start >= len(text) and not final:
                return Parsed(content="")
        elif not final and start < len(text) and PYTHON_START.startswith(text[start:]):
            return Parsed(content="")  # perhaps <|python_start|>, still being written
        if start >= len(text) or text[start] != "[":
            return Parsed(content=settled_text(text, (), final))
        calls: list[PartialCall] = []
        pos = skip_ws(text, start + 1)
        try:
            while pos < len(text):
                if not calls and text[pos] == "]":
                    raise Malformed("an empty list of calls")
                call, end = _call(text, pos, final)
                if call is not None:
                    calls.append(call)
                if end is None:  # sent once its first argument is read, so a broken call is rarely sent
                    break
                pos = skip_ws(text, end)
                if pos < len(text) and text[pos] == ",":
                    pos = skip_ws(text, pos + 1)
                elif pos < len(text) and text[pos] != "]":
                    raise Malformed("expected ',' or ']' after a call")
                else:
                    break  # ']' (what follows it is dropped) or the end of the text so far
            if final and (pos >= len(text) or text[pos] != "]"):
                raise Malformed("the output ends inside the list of calls")
        except Malformed:
            return malformed(text, final, "", [c for c in calls if c.complete])
        return Parsed(content="", calls=calls)


def _call(text: str, pos: int, final: bool) -> tuple[PartialCall | None, int | None]:
    """The call at `pos` and the index past its ')' (None while unfinished)."""
    match = _NAME.match(text, pos)
    name_end = match.end() if match else pos
    after = skip_ws(text, name_end)
    if after >= len(text):  # the name is still being written
        if final:
            raise Malformed("the output ends inside a call")
        return None, None
    if not match or text[after] != "(":
        raise Malformed("expected a function name and '('")
    name = match.group()
    members: list[str] = []
    pos = skip_ws(text, after + 1)
    while True:
        if pos >= len(text):
            return _partial(name, members, final), None
        if text[pos] == ")":
            return PartialCall(name=name, arguments="{" + ", ".join(members) + "}", complete=True), pos + 1
        key = _IDENT.match(text, pos)
        equals = skip_ws(text, key.end()) if key else pos
        if equals >= len(text):
            return _partial(name, members, final), None
        if not key or text[equals] != "=":
            raise Malformed("arguments must be keyword arguments (name=value)")
        value_start = skip_ws(text, equals + 1)
        value_end = _value_end(text, value_start)
        if value_end is None:
            return _partial(name, members, final), None
        members.append(f"{json.dumps(key.group())}: {_json_literal(text[value_start:value_end])}")
        pos = skip_ws(text, value_end)
        if text[pos] == ",":
            pos = skip_ws(text, pos + 1)


def _partial(name: str, members: list[str], final: bool) -> PartialCall | None:
    if final:
        raise Malformed("the output ends inside a call")
    if not members:
        return None
    return PartialCall(name=name, arguments="{" + ", ".join(members), complete=False)


def _value_end(text: str, pos: int) -> int | None:
    """Where the argument value at `pos` ends: the ',' or ')' that follows it outside brackets and strings."""
    depth, quote, i = 0, "", pos
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            if depth == 0:
                return i if char == ")" and i > pos else _bad_value()
            depth -= 1
        elif char == "," and depth == 0:
            return i if i > pos else _bad_value()
        i += 1
    return None


def _bad_value() -> int:
    raise Malformed("an argument without a value")


def _json_literal(source: str) -> str:
    try:
        value = ast.literal_eval(source.strip())
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise Malformed(f"not a Python literal: {source[:40]!r}") from None
