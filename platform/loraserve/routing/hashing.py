"""Sticky assignment: a user's fixed point on the weight line, and the variant whose range holds it.

Each user gets a position u in [0, 1) from SHA-256 of (tenant, route, user); it never changes. The
variants split [0, 1) into consecutive ranges proportional to their weights, in route order, and the
user gets the variant whose range holds u. In integers: point = (h * total) >> 64 for the top 64
bits h of the digest, which is floor(u * total), a number in [0, total); the variant is the first
whose cumulative weight exceeds the point.

Worked example, route variants A, B; the same user (u = 0.85) across two weight tables:

    weights 90/10   cumulative [90, 100]   A = [0.0, 0.9)   B = [0.9, 1.0)   u=0.85 -> A
    weights 80/20   cumulative [80, 100]   A = [0.0, 0.8)   B = [0.8, 1.0)   u=0.85 -> B
                                                     ^^^^^^^^^ only u in [0.8, 0.9) moves, A -> B

So a weight change moves only the users whose u lies between an old and a new boundary: 10% of
users here, all from A to B. Only ratios matter (90/10 and 9/1 assign identically, because u is
scaled to the total, not reduced modulo it). With more than two variants every moved boundary moves
the users between it and its old place, so changing one weight also shifts later ranges; keep the
order stable and append new variants at the end to move as few users as possible.
"""

from __future__ import annotations

import bisect
import hashlib
from itertools import accumulate

from loraserve.routing.route import Route, Variant

_SEPARATOR = b"\x00"  # never inside a tenant or route name, so (tenant, route, user) encode uniquely


def sticky_point(tenant: str, route_name: str, user: str, total_weight: int) -> int:
    """The user's point in [0, total_weight), stable across processes, restarts and Python versions."""
    # surrogatepass: a user id with a lone surrogate (legal in JSON text) still hashes, and always the same way.
    fields = (field.encode("utf-8", "surrogatepass") for field in (tenant, route_name, user))
    digest = hashlib.sha256(_SEPARATOR.join(fields)).digest()
    h = int.from_bytes(digest[:8], "big")  # u = h / 2**64
    return (h * total_weight) >> 64


def cumulative_weights(route: Route) -> list[int]:
    """[w0, w0 + w1, ...]: variant i owns the points [cum[i - 1], cum[i])."""
    return list(accumulate(variant.weight for variant in route.variants))


def variant_at(route: Route, point: int) -> Variant:
    """The variant whose range holds `point` (0 <= point < total weight)."""
    cumulative = cumulative_weights(route)
    if not 0 <= point < cumulative[-1]:
        raise ValueError(f"point {point} outside [0, {cumulative[-1]})")
    return route.variants[bisect.bisect_right(cumulative, point)]
