"""JSON that a model is still writing: parse a prefix, and write the part that can no longer change.

`parse_value(text, pos)` reads one JSON value starting at `pos` and returns a tree of `Node`s whose
`end` is None where the text stops inside them (a JSON syntax error raises `JsonSyntaxError` at once,
so a call that goes wrong is noticed at the first bad character). `canonical(node, text)` writes the
value as `json.dumps(value, ensure_ascii=False)` would, or, for an unfinished value, the longest prefix
of that which later text cannot change: strings grow character by character, numbers and literals
appear whole, containers close when their bracket arrives. A stream of tool-call arguments sent as the
growing `canonical` text therefore adds up to exactly the arguments of the whole response. Raw control
characters inside strings (which JSON forbids, but xgrammar's JSON grammar and some models write) are
accepted and come out escaped, so the canonical text is always valid JSON.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

MAX_DEPTH = 64  # nesting deeper than this is refused (a model looping on brackets, not a real call)
_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("+-0123456789.eE")
_LITERALS = ("true", "false", "null")
_HEX = frozenset("0123456789abcdefABCDEF")
# String characters: anything but a quote or a backslash (raw control characters too, as xgrammar's
# strings allow them), or a complete escape.
_STRING_BODY = re.compile(r'(?:[^"\\]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


class JsonSyntaxError(ValueError):
    """The text cannot be the start of a JSON value; `pos` is where it went wrong."""

    def __init__(self, message: str, pos: int = 0) -> None:
        super().__init__(message)
        self.pos = pos


@dataclass
class Node:
    kind: str  # "object", "array", "string", "number" or "literal"
    start: int
    end: int | None = None  # just past the value; None while the text stops inside it
    # object: (key, value) members; array: (None, value) elements; the last may be unfinished
    items: list[tuple[str | None, Node]] = field(default_factory=list)
    comma: bool = False  # container: a ',' was read and the next item has not started
    open_key: str | None = None  # object: a key and its ':' were read, its value has not started

    @property
    def complete(self) -> bool:
        return self.end is not None

    def get(self, key: str) -> Node | None:
        """An object's member value (the last one of that key)."""
        for name, value in reversed(self.items):
            if name == key:
                return value
        return None

    def has_key(self, key: str) -> bool:
        return any(name == key for name, _ in self.items) or self.open_key == key


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def parse_value(text: str, pos: int = 0) -> Node | None:
    """The value at `pos` (after whitespace); None if only whitespace follows."""
    return _value(text, skip_ws(text, pos), 0)


def loads_string(node: Node, text: str) -> str:
    """A complete string node's value."""
    return json.loads(text[node.start : node.end], strict=False)


def canonical(node: Node, text: str) -> str:
    """`json.dumps(value, ensure_ascii=False)`, or the part of it fixed so far for an unfinished value."""
    if node.kind == "string":
        return _canonical_string(node, text)
    if node.kind in ("number", "literal"):
        return _canonical_scalar(node, text) if node.complete else ""
    opening, closing = ("{", "}") if node.kind == "object" else ("[", "]")
    out = [opening]
    for i, (key, value) in enumerate(node.items):
        if i:
            out.append(", ")
        if key is not None:
            out.append(json.dumps(key, ensure_ascii=False) + ": ")
        out.append(canonical(value, text))
        if not value.complete:
            return "".join(out)
    if node.complete:
        out.append(closing)
    else:
        if node.comma:
            out.append(", ")
        if node.open_key is not None:
            out.append(json.dumps(node.open_key, ensure_ascii=False) + ": ")
    return "".join(out)


# ---- the parser -------------------------------------------------------------------------------------


def _value(text: str, pos: int, depth: int) -> Node | None:
    if pos >= len(text):
        return None
    if depth > MAX_DEPTH:
        raise JsonSyntaxError(f"JSON nested deeper than {MAX_DEPTH} levels", pos)
    char = text[pos]
    if char == "{":
        return _container(text, pos, depth, "object")
    if char == "[":
        return _container(text, pos, depth, "array")
    if char == '"':
        return _string(text, pos)
    if char in "-0123456789":
        return _number(text, pos)
    if char in "tfn":
        return _literal(text, pos)
    raise JsonSyntaxError(f"unexpected {char!r} at {pos}", pos)


def _container(text: str, pos: int, depth: int, kind: str) -> Node:
    node = Node(kind, pos)
    closing = "}" if kind == "object" else "]"
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return node
        char = text[i]
        if char == closing and not node.comma and node.open_key is None:
            node.end = i + 1
            return node
        if node.items and not node.comma:
            if char != ",":
                raise JsonSyntaxError(f"expected ',' or {closing!r} at {i}", i)
            node.comma = True
            i += 1
            continue
        key = None
        if kind == "object":
            if node.open_key is None:
                if char != '"':
                    raise JsonSyntaxError(f"expected a key at {i}", i)
                key_node = _string(text, i)
                if not key_node.complete:
                    return node
                i = skip_ws(text, key_node.end)
                if i >= len(text):
                    return node  # the key is read again with its ':' next time
                if text[i] != ":":
                    raise JsonSyntaxError(f"expected ':' at {i}", i)
                node.open_key = loads_string(key_node, text)
                i = skip_ws(text, i + 1)
            key = node.open_key
        value = _value(text, i, depth + 1)
        if value is None:
            return node
        node.items.append((key, value))
        node.comma, node.open_key = False, None
        if not value.complete:
            return node
        i = value.end


def _string(text: str, pos: int) -> Node:
    body = _STRING_BODY.match(text, pos + 1)  # in C: the longest run of characters and valid escapes
    i = body.end()
    if i >= len(text):
        return Node("string", pos)
    if text[i] == '"':
        return Node("string", pos, i + 1)
    # a backslash that starts no valid escape: one the text stops inside, else an error
    rest = text[i + 1 : i + 6]
    if not rest or (rest[0] == "u" and len(rest) < 5 and all(d in _HEX for d in rest[1:])):
        return Node("string", pos)
    raise JsonSyntaxError(f"invalid escape at {i}", i)


def _number(text: str, pos: int) -> Node:
    i = pos
    while i < len(text) and text[i] in _NUMBER_CHARS:
        i += 1
    run = text[pos:i]
    if i >= len(text):  # more digits may follow; only a plainly impossible start is an error now
        if not re.fullmatch(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?", run):
            raise JsonSyntaxError(f"invalid number at {pos}", pos)
        return Node("number", pos)
    if not _NUMBER.fullmatch(run):
        raise JsonSyntaxError(f"invalid number {run!r} at {pos}", pos)
    return Node("number", pos, i)


def _literal(text: str, pos: int) -> Node:
    for word in _LITERALS:
        piece = text[pos : pos + len(word)]
        if word.startswith(piece):
            return Node("literal", pos, pos + len(word) if piece == word else None)
    raise JsonSyntaxError(f"unexpected {text[pos]!r} at {pos}", pos)


# ---- canonical text ---------------------------------------------------------------------------------


def _canonical_scalar(node: Node, text: str) -> str:
    raw = text[node.start : node.end]
    if node.kind == "literal":
        return raw
    value = json.loads(raw)
    if isinstance(value, float) and not math.isfinite(value):
        raise JsonSyntaxError(f"number {raw} is out of range")
    return json.dumps(value)


def _canonical_string(node: Node, text: str) -> str:
    if node.complete:
        return _dumps_text(text[node.start + 1 : node.end - 1], closed=True)
    body = text[node.start + 1 :]
    # Cut an unfinished escape, and a high surrogate whose low half may still come.
    backslash = body.rfind("\\")
    if backslash != -1 and _escape_unfinished(body, backslash):
        body = body[:backslash]
    match = re.search(r"\\u[dD][89abAB][0-9a-fA-F]{2}$", body)
    if match and not _escaped(body, match.start()):
        body = body[: match.start()]
    return _dumps_text(body, closed=False)


def _escape_unfinished(body: str, backslash: int) -> bool:
    if _escaped(body, backslash):
        return False  # an escaped backslash
    rest = body[backslash + 1 :]
    return not rest or (rest[0] == "u" and len(rest) < 5)


def _escaped(body: str, index: int) -> bool:
    """Whether the backslash at `index` is itself escaped (an odd run of backslashes before it)."""
    run = 0
    while index - run - 1 >= 0 and body[index - run - 1] == "\\":
        run += 1
    return run % 2 == 1


def _dumps_text(body: str, closed: bool) -> str:
    value = json.loads(f'"{body}"', strict=False)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonSyntaxError("a string holds a lone surrogate escape") from None
    dumped = json.dumps(value, ensure_ascii=False)
    return dumped if closed else dumped[:-1]
