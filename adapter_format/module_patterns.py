"""Regular expressions from adapter_config.json, matched against module names as PEFT matches them.

PEFT reads several config keys as regexes over the base model's module names (`model.layers.3.self_attn.q_proj`):
rank_pattern and alpha_pattern keys, a string target_modules or exclude_modules, layers_pattern. An adapter
is untrusted input, so a hostile pattern must not hang a load: compiling is bounded by the product of the
counted repetitions (`{m,n}`), which its cost grows with, and all the matching of one adapter shares one
time budget (`deadline`, from time.monotonic). One place for both bounds.
"""

from __future__ import annotations

import time

import regex

from adapter_format.errors import AdapterError, show_value
from adapter_format.files import CONFIG_FILE

PATTERN_MATCH_BUDGET_S = 1.0
MAX_REPEAT_PRODUCT = 4096
_COUNTED_REPEAT = regex.compile(r"\{(\d*)(?:,(\d*))?\}")


def compile_pattern(text: str, field: str, template: str = "{}") -> regex.Pattern:
    """`template` with the config's `text` in it, compiled; AdapterError (code `bad_{field}`) if it is not a
    valid regex or repeats too much to compile quickly."""
    repeats = 1
    for low, high in _COUNTED_REPEAT.findall(text):
        repeats *= max(int(low or 0), int(high or 0), 1)
    if repeats > MAX_REPEAT_PRODUCT:
        raise pattern_error(
            field,
            f"{show_value(text)} repeats too much: its {{m,n}} counts multiply to more than {MAX_REPEAT_PRODUCT}",
        )
    try:
        return regex.compile(template.format(text))
    except regex.error as exc:
        raise pattern_error(field, f"{show_value(text)} is not a valid regex ({exc})") from None


def search(
    pattern: regex.Pattern, key: str, deadline: float, field: str, how: str = "match"
) -> regex.Match | None:
    """`pattern.match(key)` (or `fullmatch`), within what is left of the adapter's time budget."""
    try:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return getattr(pattern, how)(key, timeout=left)
    except TimeoutError:
        raise pattern_error(
            field,
            f"takes too long to match the model's module names (at {show_value(pattern.pattern)}); use plain "
            "module names or simple patterns",
        ) from None


def new_deadline() -> float:
    return time.monotonic() + PATTERN_MATCH_BUDGET_S


def pattern_error(field: str, what: str) -> AdapterError:
    return AdapterError(f"bad_{field}", f"{CONFIG_FILE}: {field} {what}", field)
