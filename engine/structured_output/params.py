"""What a request's output must follow (vLLM's `StructuredOutputsParams`, one kind per request)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused before compiling


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (EBNF, xgrammar's dialect of GBNF)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or grammar "
                f"(got {', '.join(given) or 'none'})"
            )
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        spec = self.spec_text
        if spec is not None and len(spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the structured output spec is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def spec_text(self) -> str | None:
        """The spec as one string (for size checks and cache keys); None for json_object."""
        if self.choice is not None:
            return "\n".join(self.choice)
        value: Any = self.json or self.regex or self.grammar
        return value


def _schema_text(schema: dict) -> str:
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the JSON schema cannot be written as JSON: {exc}") from None
