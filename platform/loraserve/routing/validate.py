"""Validate route bodies from users, with messages that name the field and the fix (the API's 422).

Checked by hand rather than by msgspec's decoder so every message says which variant is wrong and
what a correct body looks like, and so `true` is never taken for weight 1.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from loraserve.routing.route import STICKY_MODES, AdapterRef, Route, Variant, parse_adapter_ref
from loraserve.tenancy.errors import InvalidName
from loraserve.tenancy.names import check_route_name

MAX_VARIANTS = 64
MAX_WEIGHT = 1_000_000
EXAMPLE = '{"variants": [{"adapter": "a", "weight": 90}, {"adapter": "b@2", "weight": 10}], "sticky": "user"}'
_ROUTE_FIELDS = {"name", "variants", "sticky"}
_VARIANT_FIELDS = {"adapter", "weight"}


class InvalidRoute(ValueError):
    """A route body that cannot be stored; `field` is the JSON path at fault (e.g. `variants[1].weight`)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def parse_route(name: str, body: Mapping[str, object] | bytes | str) -> Route:
    """Validate `PUT /v1/routes/{name}`'s body (decoded or raw JSON) into a Route."""
    try:
        check_route_name(name)
    except InvalidName as exc:
        raise InvalidRoute(str(exc), field="name") from None
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRoute(f"route body is not valid JSON ({exc}); send e.g. {EXAMPLE}") from None
    if not isinstance(body, Mapping):
        raise InvalidRoute(f"route body must be a JSON object, e.g. {EXAMPLE}")
    unknown = sorted(set(map(str, body)) - _ROUTE_FIELDS)
    if unknown:
        raise InvalidRoute(f"unknown route field(s) {unknown}; allowed: variants, sticky", field=unknown[0])
    if "name" in body and body["name"] != name:
        raise InvalidRoute(
            f"body name {body['name']!r} differs from the URL's route name {name!r}", field="name"
        )
    sticky = body.get("sticky", "user")
    if sticky not in STICKY_MODES:
        raise InvalidRoute(f"sticky must be 'user' or 'none' (got {sticky!r})", field="sticky")
    return Route(name=name, variants=_parse_variants(body.get("variants")), sticky=sticky)


def validate_route(route: Route) -> Route:
    """Re-check a Route built in code (e.g. decoded by the web framework) with the same rules."""
    body = {
        "variants": [{"adapter": v.adapter, "weight": v.weight} for v in route.variants],
        "sticky": route.sticky,
    }
    return parse_route(route.name, body)


async def check_route_adapters(route: Route, exists: Callable[[AdapterRef], Awaitable[bool]]) -> None:
    """Refuse a route naming an adapter the tenant does not have; `exists` asks the adapter store."""
    for index, variant in enumerate(route.variants):
        ref = parse_adapter_ref(variant.adapter)
        if not await exists(ref):
            raise InvalidRoute(
                f"variants[{index}].adapter {variant.adapter!r} is not an adapter of this tenant; "
                "upload it first (POST /v1/adapters) or fix the name",
                field=f"variants[{index}].adapter",
            )


def _parse_variants(raw: object) -> tuple[Variant, ...]:
    if raw is None:
        raise InvalidRoute(f"'variants' is required, e.g. {EXAMPLE}", field="variants")
    if not isinstance(raw, list) or not raw:
        raise InvalidRoute(f"'variants' must be a non-empty list, e.g. {EXAMPLE}", field="variants")
    if len(raw) > MAX_VARIANTS:
        raise InvalidRoute(f"a route has at most {MAX_VARIANTS} variants (got {len(raw)})", field="variants")
    variants: list[Variant] = []
    seen: dict[AdapterRef, int] = {}
    for index, item in enumerate(raw):
        at = f"variants[{index}]"
        if not isinstance(item, Mapping):
            raise InvalidRoute(f'{at} must be an object like {{"adapter": "a", "weight": 90}}', field=at)
        unknown = sorted(set(map(str, item)) - _VARIANT_FIELDS)
        if unknown:
            raise InvalidRoute(f"{at} has unknown field(s) {unknown}; allowed: adapter, weight", field=at)
        if "adapter" not in item:
            raise InvalidRoute(f"{at}.adapter is required ('name' or 'name@version')", field=f"{at}.adapter")
        try:
            ref = parse_adapter_ref(item["adapter"])
        except InvalidName as exc:
            raise InvalidRoute(f"{at}.adapter: {exc}", field=f"{at}.adapter") from None
        if ref in seen:
            raise InvalidRoute(
                f"{at}.adapter {str(ref)!r} repeats variants[{seen[ref]}]; list each adapter once and merge the weights",
                field=f"{at}.adapter",
            )
        seen[ref] = index
        weight = item.get("weight")
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= MAX_WEIGHT:
            raise InvalidRoute(
                f"{at}.weight must be a positive integer up to {MAX_WEIGHT} (got {weight!r}); "
                "weights are relative, e.g. 90 and 10",
                field=f"{at}.weight",
            )
        variants.append(Variant(adapter=str(ref), weight=weight))
    return tuple(variants)
