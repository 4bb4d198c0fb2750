"""What a request's `model` turned out to mean for its tenant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from loraserve.errors import NotFound

ModelKind = Literal["base", "adapter", "route", "merge"]


@dataclass(frozen=True)
class ResolvedModel:
    kind: ModelKind
    engine_adapter_id: (
        str | None
    )  # `tenant/name@version` (a merge: `tenant/merge+<key>`); None: the base model
    served_model: str  # the response's `model`: the base model id, or `name@version` of the adapter used
    route: str | None = None  # the route's name when `model` named one
    variant: str | None = None  # the picked variant's adapter as the route spells it (`b` or `b@2`)
    tool_call_parser: str | None = None  # the adapter's own parser for tool_choice "auto" (its upload's)


class ModelNotFound(NotFound):
    """404 `model_not_found`; the same answer for a missing model and another tenant's."""

    code = "model_not_found"
