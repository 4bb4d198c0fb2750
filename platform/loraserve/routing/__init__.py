"""A/B routing: route records and their validation, sticky hashing, and the Router that picks variants."""

from loraserve.routing.hashing import cumulative_weights, sticky_point, variant_at
from loraserve.routing.route import STICKY_MODES, AdapterRef, Route, Sticky, Variant, parse_adapter_ref
from loraserve.routing.router import PickHook, Router
from loraserve.routing.validate import (
    MAX_VARIANTS,
    MAX_WEIGHT,
    InvalidRoute,
    check_route_adapters,
    parse_route,
    validate_route,
)

__all__ = [
    "MAX_VARIANTS",
    "MAX_WEIGHT",
    "STICKY_MODES",
    "AdapterRef",
    "InvalidRoute",
    "PickHook",
    "Route",
    "Router",
    "Sticky",
    "Variant",
    "check_route_adapters",
    "cumulative_weights",
    "parse_adapter_ref",
    "parse_route",
    "sticky_point",
    "validate_route",
    "variant_at",
]
