"""The errors of adapter files and names: AdapterError for an adapter the engine cannot serve (and the store
refuses to take), InvalidName for a name, version, reference or id outside the syntax (names.py)."""

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


class InvalidName(ValueError):
    """A tenant, adapter or route name, version, `name@version` reference or adapter id outside the safe
    syntax (adapter_format/names.py). The store and the server raise this one class; the API answers 422."""

    code = "invalid_name"


def show_value(value: object) -> str:
    """A value for a message: its repr, cut short (a config field or tensor name may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
