"""Parse untrusted JSON (adapter configs, safetensors headers) with the nesting depth bounded first.

`json.loads` recurses once per level: 200,000 nested `[` raise RecursionError deep inside the parser.
So the depth is measured before parsing, at C speed on the raw bytes: strings are cut out (escaped
backslashes, then escaped quotes, then everything between quotes), the brackets that remain are kept,
and each pass of `replace("[]", "")` removes exactly one level. Numbers too long to be meant
(Python refuses to convert more than 4,300 digits anyway) become `LongNumber`, so the caller's type
check names the field instead of the parser failing on the whole file.
"""

from __future__ import annotations

import json
from collections.abc import Callable

# Every byte but the four brackets: `bytes.translate(None, _NOT_BRACKETS)` keeps only the brackets.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
# Longer integer literals are no count, rank or offset anyone means (2**64 has 20 digits).
MAX_INT_DIGITS = 40


class LongNumber:
    """An integer literal of more than MAX_INT_DIGITS digits, kept as its length only."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"a {self.digits}-digit number"


def nesting_depth_exceeds(data: bytes, max_depth: int) -> bool:
    """True if the arrays and objects of JSON text `data` nest more than `max_depth` levels.

    Exact for valid JSON; for invalid JSON it may answer either way, and the parser refuses it then.
    """
    text = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = b"".join(text.split(b'"')[0::2])
    brackets = outside_strings.translate(_CURLY_TO_SQUARE, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        inner_removed = brackets.replace(b"[]", b"")
        if len(inner_removed) == len(brackets):
            return True  # unbalanced: never valid JSON
        brackets = inner_removed
    return bool(brackets)


def loads_bounded(
    data: bytes, max_depth: int, object_pairs_hook: Callable[[list[tuple[str, object]]], object] | None = None
) -> object:
    """`json.loads` of UTF-8 `data`; ValueError (with a reason for the user) if invalid or too deep."""
    if nesting_depth_exceeds(data, max_depth):
        raise ValueError(f"it nests arrays or objects more than {max_depth} levels deep")
    try:
        return json.loads(data.decode("utf-8"), parse_int=_parse_int, object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as exc:
        raise ValueError(f"it is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:  # unreachable after the depth check; kept so no input can raise it
        raise ValueError(f"it nests arrays or objects more than {max_depth} levels deep") from None


def _parse_int(literal: str) -> int | LongNumber:
    digits = len(literal.lstrip("-"))
    return int(literal) if digits <= MAX_INT_DIGITS else LongNumber(digits)
