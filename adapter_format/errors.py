"""The one error type for adapters the engine cannot serve (and the store refuses to take)."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter the engine cannot serve; `code` names the failed check, `field` the config key at fault.

    The adapter store wraps it (InvalidAdapter) and the HTTP layer answers 422 with `field` as `param`.
    """

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field

    def __reduce__(self):  # raised in a loader process, re-raised in the engine's: keep code and field
        return type(self), (self.code, str(self), self.field)


def show_value(value: object) -> str:
    """A value for a message: its repr, cut short (a config field or tensor name may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
