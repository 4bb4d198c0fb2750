"""Which of a tenant's routes would break if some versions of an adapter were deleted.

A variant `name@3` (or a merge with part `name@3`) needs version 3; a bare `name` needs some version to remain (it serves the latest,
so deleting the latest while older versions remain moves it to the newest of those). Deleting what a
route needs is refused (409 naming the route) rather than leaving the route answering 404 to its users.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraserve.routing.route import Route, parse_adapter_ref


def variants_needing(
    routes: Iterable[Route], name: str, deleted: Iterable[int], remaining: Iterable[int]
) -> list[tuple[str, str]]:
    """(route name, variant) pairs that deleting versions `deleted` of adapter `name` would break.

    `remaining`: the versions of `name` that would still exist afterwards.
    """
    deleted, any_left = set(deleted), bool(set(remaining))
    broken = []
    for route in routes:
        for variant in route.variants:
            for written in variant.adapter_refs:  # one, or a merge's parts
                ref = parse_adapter_ref(written)
                if ref.name != name:
                    continue
                if (ref.version is None and not any_left) or ref.version in deleted:
                    broken.append((route.name, variant.label))
                    break
    return broken
