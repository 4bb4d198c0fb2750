"""Router: sticky splits, stability, minimal movement on weight changes, fresh draws, validation."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from loraserve.routing import (
    MAX_VARIANTS,
    AdapterRef,
    InvalidRoute,
    Route,
    Router,
    Variant,
    check_route_adapters,
    parse_adapter_ref,
    parse_route,
    sticky_point,
    validate_route,
    variant_at,
)
from loraserve.tenancy import InvalidName

USERS = [f"user-{i}" for i in range(10_000)]


def ab(*weights: int, sticky: str = "user", name: str = "chat") -> Route:
    variants = tuple(Variant(adapter=adapter, weight=w) for adapter, w in zip("abcdefgh", weights))
    return Route(name=name, variants=variants, sticky=sticky)


def assign(route: Route, tenant: str = "acme") -> dict[str, str]:
    router = Router()
    return {user: router.pick(tenant, route, user).adapter for user in USERS}


def test_10000_users_split_90_10_within_one_and_a_half_points():
    counts = Counter(assign(ab(90, 10)).values())
    assert abs(counts["a"] / len(USERS) - 0.90) <= 0.015
    assert abs(counts["b"] / len(USERS) - 0.10) <= 0.015


def test_a_user_always_gets_the_same_variant():
    route = ab(50, 30, 20)
    first = assign(route)
    assert assign(route) == first  # a fresh Router (another replica, a restart): same answers
    router = Router(rng=random.Random(1))
    assert all(
        router.pick("acme", route, user).adapter == first[user] for user in USERS[:500] for _ in range(3)
    )


def test_the_hash_is_stable_across_versions():
    """Pinned values: changing the hash would reshuffle every user of every deployed route."""
    assert [sticky_point("acme", "chat", user, 100) for user in ("alice", "bob", "user-7")] == [27, 5, 9]
    assert [sticky_point("acme", "chat", user, 2**32) for user in ("alice", "bob")] == [1176392992, 224686303]


def test_tenant_and_route_are_part_of_the_hash():
    route = ab(50, 50)
    base, other_tenant, other_route = (
        assign(route),
        assign(route, tenant="other"),
        assign(ab(50, 50, name="other")),
    )
    assert sum(base[u] != other_tenant[u] for u in USERS) > 4000  # about half differ: independent hashes
    assert sum(base[u] != other_route[u] for u in USERS) > 4000


def test_weight_change_moves_only_the_users_it_must():
    before, after = assign(ab(90, 10)), assign(ab(80, 20))
    moved = [user for user in USERS if before[user] != after[user]]
    assert abs(len(moved) / len(USERS) - 0.10) <= 0.015
    assert all(before[user] == "a" and after[user] == "b" for user in moved)


def test_only_ratios_matter():
    assert assign(ab(90, 10)) == assign(ab(9, 1))


def test_appending_a_variant_takes_users_only_from_the_range_it_replaces():
    before, after = assign(ab(50, 50)), assign(ab(50, 30, 20))
    moved = {(before[u], after[u]) for u in USERS if before[u] != after[u]}
    assert moved == {("b", "c")}
    assert all(after[u] == "a" for u in USERS if before[u] == "a")


def test_sticky_none_draws_fresh_by_weight():
    router = Router(rng=random.Random(7))
    picks = Counter(
        router.pick("acme", ab(90, 10, sticky="none"), "same-user").adapter for _ in range(10_000)
    )
    assert abs(picks["a"] / 10_000 - 0.90) <= 0.015 and picks["b"] > 0


@pytest.mark.parametrize("user", [None, ""])
def test_no_user_draws_fresh_even_on_sticky_routes(user):
    router, rng = Router(), random.Random(3)
    picks = Counter(router.pick("acme", ab(50, 50), user, rng=rng).adapter for _ in range(2000))
    assert 900 < picks["a"] < 1100


def test_pick_hook_counts_variants():
    seen: Counter[tuple[str, str, str, bool]] = Counter()
    router = Router(
        on_pick=lambda tenant, route, variant, sticky: seen.update([(tenant, route, variant.adapter, sticky)])
    )
    route = ab(1, 1)
    for user in USERS[:100]:
        router.pick("acme", route, user)
    router.pick("acme", route)
    assert sum(seen.values()) == 101
    assert sum(n for (_, _, _, sticky), n in seen.items() if not sticky) == 1
    assert {adapter for (_, _, adapter, _) in seen} == {"a", "b"}


def test_variant_at_ranges():
    route = ab(3, 1, 2)  # a: 0..2, b: 3, c: 4..5
    assert [variant_at(route, p).adapter for p in range(6)] == ["a", "a", "a", "b", "c", "c"]
    with pytest.raises(ValueError):
        variant_at(route, 6)


# validation


def test_parse_route_accepts_the_documented_body():
    body = (
        '{"variants": [{"adapter": "a", "weight": 90}, {"adapter": "b@2", "weight": 10}], "sticky": "user"}'
    )
    route = parse_route("chat", body)
    assert route == Route(
        name="chat", variants=(Variant(adapter="a", weight=90), Variant(adapter="b@2", weight=10))
    )
    assert parse_route("chat", {"variants": [{"adapter": "a", "weight": 1}]}).sticky == "user"  # the default
    assert parse_route(
        "chat", {"name": "chat", "variants": [{"adapter": "a", "weight": 1}], "sticky": "none"}
    )
    assert validate_route(route) == route


def v(adapter: object = "a", weight: object = 1) -> dict[str, object]:
    return {"adapter": adapter, "weight": weight}


@pytest.mark.parametrize(
    "name, body, field, message",
    [
        ("bad/name", {"variants": [v()]}, "name", "route name 'bad/name' contains a path separator"),
        ("a@1", {"variants": [v()]}, "name", "contains '@'"),
        ("chat", b"{not json", None, "not valid JSON"),
        ("chat", [v()], None, "must be a JSON object"),
        ("chat", {}, "variants", "'variants' is required"),
        ("chat", {"variants": []}, "variants", "non-empty list"),
        ("chat", {"variants": v()}, "variants", "non-empty list"),
        ("chat", {"variants": [v()] * (MAX_VARIANTS + 1)}, "variants", "at most 64 variants"),
        ("chat", {"variants": ["a"]}, "variants[0]", "must be an object"),
        ("chat", {"variants": [{"weight": 1}]}, "variants[0].adapter", "adapter is required"),
        ("chat", {"variants": [v(adapter=3)]}, "variants[0].adapter", "must be a string"),
        ("chat", {"variants": [v(adapter="")]}, "variants[0].adapter", "empty"),
        ("chat", {"variants": [v(adapter="../x")]}, "variants[0].adapter", "contains '..'"),
        ("chat", {"variants": [v(adapter="-x")]}, "variants[0].adapter", "invalid"),
        ("chat", {"variants": [v(adapter="a@0")]}, "variants[0].adapter", "positive integer"),
        ("chat", {"variants": [v(adapter="a@01")]}, "variants[0].adapter", "leading zeros"),
        ("chat", {"variants": [v(adapter="a@x")]}, "variants[0].adapter", "positive integer"),
        ("chat", {"variants": [v(adapter="a@2@3")]}, "variants[0].adapter", "positive integer"),
        ("chat", {"variants": [v(), v("b"), v("a")]}, "variants[2].adapter", "repeats variants[0]"),
        ("chat", {"variants": [v("a@2"), v("a@2")]}, "variants[1].adapter", "repeats variants[0]"),
        ("chat", {"variants": [{"adapter": "a"}]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight=0)]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight=-5)]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight=1.5)]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight=1.0)]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight="10")]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight=True)]}, "variants[0].weight", "positive integer"),
        ("chat", {"variants": [v(weight=10**9)]}, "variants[0].weight", "up to 1000000"),
        ("chat", {"variants": [{**v(), "weigth": 2}]}, "variants[0]", "unknown field(s) ['weigth']"),
        ("chat", {"variants": [v()], "sticky": "session"}, "sticky", "'user' or 'none'"),
        ("chat", {"variants": [v()], "stickiness": "user"}, "stickiness", "unknown route field(s)"),
        ("chat", {"name": "other", "variants": [v()]}, "name", "differs from the URL"),
    ],
)
def test_route_validation_errors(name, body, field, message):
    with pytest.raises(InvalidRoute) as excinfo:
        parse_route(name, body)
    assert message in str(excinfo.value)
    assert excinfo.value.field == field


def test_distinct_versions_of_one_adapter_are_allowed():
    route = parse_route("chat", {"variants": [v("a"), v("a@1"), v("a@2")]})
    assert [variant.adapter for variant in route.variants] == ["a", "a@1", "a@2"]


@pytest.mark.parametrize(
    "ref, expected",
    [
        ("a", AdapterRef(name="a")),
        ("a@2", AdapterRef(name="a", version=2)),
        ("my.adapter_v1@123", AdapterRef(name="my.adapter_v1", version=123)),
    ],
)
def test_parse_adapter_ref(ref, expected):
    assert parse_adapter_ref(ref) == expected and str(expected) == ref


@pytest.mark.parametrize("ref", ["", "@2", "a@", "a@-1", "a b", None])
def test_parse_adapter_ref_refuses(ref):
    with pytest.raises(InvalidName):
        parse_adapter_ref(ref)


def test_every_variant_must_name_an_existing_adapter():
    have = {AdapterRef(name="a"), AdapterRef(name="b", version=2)}

    async def exists(ref: AdapterRef) -> bool:
        return ref in have

    asyncio.run(check_route_adapters(parse_route("chat", {"variants": [v("a"), v("b@2")]}), exists))
    with pytest.raises(
        InvalidRoute, match=r"variants\[1\].adapter 'b@3' is not an adapter of this tenant"
    ) as excinfo:
        asyncio.run(check_route_adapters(parse_route("chat", {"variants": [v("a"), v("b@3")]}), exists))
    assert excinfo.value.field == "variants[1].adapter"
