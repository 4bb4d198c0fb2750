"""Validate route bodies from users, with messages that name the field and the fix (the API's 422).

Checked by hand rather than by msgspec's decoder so every message says which variant is wrong and
what a correct body looks like, and so `true` is never taken for weight 1. A variant is one adapter
(`adapter`) or a merge of several (`merge`, the fields of a request's merged_adapters).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from adapter_format.names import check_route_name
from loraserve.merges.fields import MergedAdapters
from loraserve.merges.spec import InvalidMerge, check_merge
from loraserve.routing.route import STICKY_MODES, AdapterRef, Route, Variant, parse_adapter_ref
from loraserve.tenancy.errors import InvalidName

MAX_VARIANTS = 64
MAX_WEIGHT = 1_000_000
EXAMPLE = '{"variants": [{"adapter": "a", "weight": 90}, {"adapter": "b@2", "weight": 10}], "sticky": "user"}'
_ROUTE_FIELDS = {"name", "variants", "sticky"}
_VARIANT_FIELDS = {"adapter", "merge", "weight"}


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
        "variants": [msgspec.to_builtins(v) for v in route.variants],
        "sticky": route.sticky,
    }
    return parse_route(route.name, body)


async def check_route_adapters(route: Route, exists: Callable[[AdapterRef], Awaitable[bool]]) -> None:
    """Refuse a route naming an adapter the tenant does not have; `exists` asks the adapter store."""
    for index, variant in enumerate(route.variants):
        for part, written in enumerate(variant.adapter_refs):
            if not await exists(parse_adapter_ref(written)):
                at = (
                    f"variants[{index}].adapter"
                    if variant.merge is None
                    else f"variants[{index}].merge.ids[{part}]"
                )
                raise InvalidRoute(
                    f"{at} {written!r} is not an adapter of this tenant; "
                    "upload it first (POST /v1/adapters) or fix the name",
                    field=at,
                )


def _parse_variants(raw: object) -> tuple[Variant, ...]:
    if raw is None:
        raise InvalidRoute(f"'variants' is required, e.g. {EXAMPLE}", field="variants")
    if not isinstance(raw, list) or not raw:
        raise InvalidRoute(f"'variants' must be a non-empty list, e.g. {EXAMPLE}", field="variants")
    if len(raw) > MAX_VARIANTS:
        raise InvalidRoute(f"a route has at most {MAX_VARIANTS} variants (got {len(raw)})", field="variants")
    variants: list[Variant] = []
    seen: dict[object, int] = {}  # adapter refs and merges
    for index, item in enumerate(raw):
        at = f"variants[{index}]"
        if not isinstance(item, Mapping):
            raise InvalidRoute(f'{at} must be an object like {{"adapter": "a", "weight": 90}}', field=at)
        unknown = sorted(set(map(str, item)) - _VARIANT_FIELDS)
        if unknown:
            raise InvalidRoute(
                f"{at} has unknown field(s) {unknown}; allowed: adapter or merge, weight", field=at
            )
        if "adapter" not in item and "merge" not in item:
            raise InvalidRoute(
                f"{at}.adapter is required ('name' or 'name@version'), or {at}.merge for a merge of several "
                '(as a request\'s merged_adapters, e.g. {"ids": ["a", "b"], "weights": [0.5, 0.5]})',
                field=f"{at}.adapter",
            )
        if "adapter" in item and "merge" in item:
            raise InvalidRoute(
                f"{at} names an adapter and a merge: give one, not both", field=f"{at}.adapter"
            )
        merge = _parse_merge(item["merge"], f"{at}.merge") if "merge" in item else None
        key: object = merge
        if merge is None:
            try:
                key = ref = parse_adapter_ref(item["adapter"])
            except InvalidName as exc:
                raise InvalidRoute(f"{at}.adapter: {exc}", field=f"{at}.adapter") from None
        if key in seen and merge is None:
            raise InvalidRoute(
                f"{at}.adapter {str(key)!r} repeats variants[{seen[key]}]; list each adapter once and merge the weights",
                field=f"{at}.adapter",
            )
        if key in seen:
            raise InvalidRoute(
                f"{at}.merge repeats variants[{seen[key]}]; list each merge once and add up the weights",
                field=f"{at}.merge",
            )
        seen[key] = index
        weight = item.get("weight")
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= MAX_WEIGHT:
            raise InvalidRoute(
                f"{at}.weight must be a positive integer up to {MAX_WEIGHT} (got {weight!r}); "
                "weights are relative, e.g. 90 and 10",
                field=f"{at}.weight",
            )
        if merge is None:
            variants.append(Variant(adapter=str(ref), weight=weight))
        else:
            variants.append(Variant(merge=merge, weight=weight))
    return tuple(variants)


def _parse_merge(raw: object, at: str) -> MergedAdapters:
    """A variant's merge: the request field's shape and rules (loraserve.merges.spec)."""
    try:
        merge = msgspec.convert(raw, MergedAdapters)
    except msgspec.ValidationError as exc:
        raise InvalidRoute(
            f'{at}: {exc}; e.g. {{"ids": ["a", "b@2"], "weights": [0.7, 0.3]}}', field=at
        ) from None
    try:
        check_merge(merge, at)
    except InvalidMerge as exc:
        raise InvalidRoute(str(exc), field=exc.field) from None
    return merge
