"""Pick the variant of an A/B route that serves one request.

`sticky: user` with a user id: the same user always gets the same variant (see hashing.py for why a
weight change moves only the users it must). No user id, or `sticky: none`: a fresh weighted draw per
request. A pick hook lets the server count requests per variant without this module knowing about
Prometheus.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from loraserve.routing.hashing import sticky_point, variant_at
from loraserve.routing.route import Route, Variant

# on_pick(tenant, route_name, variant, sticky): called once per pick, e.g. to bump a labelled counter.
PickHook = Callable[[str, str, Variant, bool], None]


class Router:
    def __init__(self, on_pick: PickHook | None = None, rng: random.Random | None = None) -> None:
        self._on_pick = on_pick
        self._rng = rng if rng is not None else random.Random()

    def pick(
        self, tenant: str, route: Route, user: str | None = None, rng: random.Random | None = None
    ) -> Variant:
        """The variant for this request; `rng` overrides the router's generator for fresh draws."""
        total = route.total_weight
        if total <= 0:
            raise ValueError(
                f"route {route.name!r} has no positive weight; validate routes before storing them"
            )
        sticky = route.sticky == "user" and bool(user)
        if sticky:
            point = sticky_point(tenant, route.name, user, total)
        else:
            point = (rng or self._rng).randrange(total)
        variant = variant_at(route, point)
        if self._on_pick is not None:
            self._on_pick(tenant, route.name, variant, sticky)
        return variant
