"""Response bodies of the route API; a route itself is `loraserve.routing.Route` (name, variants, sticky)."""

from __future__ import annotations

from typing import Literal

import msgspec

from loraserve.routing import Route


class RouteList(msgspec.Struct, frozen=True, kw_only=True):
    """The tenant's routes sorted by name (OpenAI's list shape)."""

    data: list[Route]
    object: Literal["list"] = "list"


class RouteDeleted(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    deleted: bool = True
    object: Literal["route.deleted"] = "route.deleted"
