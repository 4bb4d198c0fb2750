"""resolve_model and list_models: base model, adapters by name and version, A/B routes, isolation."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from api_env import ADMIN_A, ADMIN_B, BASE_MODEL, USER_A, bearer
from litestar.testing import TestClient
from loraserve.adapter_lookup import AdapterLookup
from loraserve.errors import NotFound
from loraserve.resolution import ModelNotFound, ResolvedModel, list_models, resolve_model
from loraserve.routing import Route, Variant

from adapters_store import AdapterFiles


def files(folder):
    return AdapterFiles(config=folder / "adapter_config.json", weights=folder / "adapter_model.safetensors")


@pytest.fixture
def env(api_env, peft_adapters):
    """Alpha has `a` (versions 1, 2) and `b` (version 1); beta has `secret`."""
    env = api_env()
    store = env.services.adapter_store
    store.put("alpha", "a", files(peft_adapters["qv"]))
    store.put("alpha", "a", files(peft_adapters["all"]))
    store.put("alpha", "b", files(peft_adapters["qv"]))
    store.put("beta", "secret", files(peft_adapters["qv"]))
    return env


def resolve(env, key, model, user=None):
    return asyncio.run(resolve_model(env.services, env.principals[key], model, user))


def put_route(env, tenant, route):
    asyncio.run(env.services.config_store.put_route(tenant, route))


def test_base_model_and_adapters(env):
    assert resolve(env, USER_A, BASE_MODEL) == ResolvedModel(
        kind="base", engine_adapter_id=None, served_model=BASE_MODEL
    )
    assert resolve(env, USER_A, "a") == ResolvedModel(
        kind="adapter", engine_adapter_id="alpha/a@2", served_model="a@2"
    )
    assert resolve(env, USER_A, "a@1").engine_adapter_id == "alpha/a@1"
    assert resolve(env, ADMIN_B, "secret").engine_adapter_id == "beta/secret@1"


@pytest.mark.parametrize("model", ["nothing", "a@3", "a@0", "a@x", "secret", "secret@1", "../a", ""])
def test_unknown_and_other_tenants_models_are_model_not_found(env, model):
    with pytest.raises(ModelNotFound) as caught:
        resolve(env, ADMIN_A, model)
    assert isinstance(caught.value, NotFound) and caught.value.status_code == 404
    assert caught.value.code == "model_not_found"
    assert repr(model) in str(caught.value)


def test_sticky_route_gives_each_user_one_variant(env):
    put_route(
        env,
        "alpha",
        Route(name="exp", variants=(Variant(adapter="a@1", weight=50), Variant(adapter="b", weight=50))),
    )
    seen = Counter()
    for user in (f"user-{i}" for i in range(200)):
        first = resolve(env, USER_A, "exp", user)
        assert first.kind == "route" and first.route == "exp"
        assert {resolve(env, USER_A, "exp", user) for _ in range(3)} == {first}
        seen[(first.variant, first.served_model, first.engine_adapter_id)] += 1
    assert set(seen) == {("a@1", "a@1", "alpha/a@1"), ("b", "b@1", "alpha/b@1")}
    assert 60 <= seen[("a@1", "a@1", "alpha/a@1")] <= 140  # 50/50 over 200 users


def test_non_sticky_route_draws_per_request(env):
    put_route(
        env,
        "alpha",
        Route(
            name="exp",
            variants=(Variant(adapter="a", weight=1), Variant(adapter="b", weight=1)),
            sticky="none",
        ),
    )
    served = {resolve(env, USER_A, "exp", "same-user").served_model for _ in range(60)}
    assert served == {"a@2", "b@1"}


def test_route_takes_over_an_adapter_name_and_a_missing_variant_is_named(env):
    put_route(env, "alpha", Route(name="a", variants=(Variant(adapter="b", weight=1),)))
    assert resolve(env, USER_A, "a").served_model == "b@1"
    assert resolve(env, USER_A, "a@1").served_model == "a@1"  # name@version is always the adapter
    put_route(env, "alpha", Route(name="gone", variants=(Variant(adapter="b@9", weight=1),)))
    with pytest.raises(ModelNotFound, match=r"route 'gone' picked adapter 'b@9'"):
        resolve(env, USER_A, "gone")
    put_route(env, "beta", Route(name="theirs", variants=(Variant(adapter="secret", weight=1),)))
    with pytest.raises(ModelNotFound):
        resolve(env, USER_A, "theirs")


def test_lookup_caches_for_its_ttl_and_shares_concurrent_misses(env, peft_adapters):
    store = env.services.adapter_store
    now = [0.0]
    lookup = AdapterLookup(ttl_s=0.5, clock=lambda: now[0])
    calls = Counter()
    real_get = store.get

    def counting_get(*args):
        calls[args] += 1
        return real_get(*args)

    store.get = counting_get

    async def burst():
        return await asyncio.gather(*(lookup.resolve(store, "alpha", "a") for _ in range(20)))

    assert {r.version for r in asyncio.run(burst())} == {2}
    assert calls[("alpha", "a", None)] == 1
    store.put("alpha", "a", files(peft_adapters["qv"]))  # as another replica would: no invalidation here
    now[0] = 0.4
    assert asyncio.run(lookup.resolve(store, "alpha", "a")).version == 2
    now[0] = 0.6
    assert asyncio.run(lookup.resolve(store, "alpha", "a")).version == 3
    lookup.invalidate("alpha", "a")
    asyncio.run(lookup.resolve(store, "alpha", "a"))
    assert calls[("alpha", "a", None)] == 3


def test_list_models_lists_the_tenants_names(env):
    put_route(env, "alpha", Route(name="exp", variants=(Variant(adapter="a", weight=1),)))
    listed = asyncio.run(list_models(env.services, env.principals[USER_A]))
    assert listed.object == "list"
    assert [(m.id, m.kind) for m in listed.data] == [
        (BASE_MODEL, "base"),
        ("a", "adapter"),
        ("b", "adapter"),
        ("a@1", "adapter"),
        ("a@2", "adapter"),
        ("b@1", "adapter"),
        ("exp", "route"),
    ]
    assert {m.root for m in listed.data if m.id == "a"} == {"a@2"}
    assert all(m.owned_by == "alpha" and m.parent == BASE_MODEL for m in listed.data[1:])
    assert listed.data[0].max_model_len == env.services.max_model_len  # vLLM's, on the base model's card
    assert all(m.max_model_len is None for m in listed.data[1:])
    beta = asyncio.run(list_models(env.services, env.principals[ADMIN_B]))
    assert [m.id for m in beta.data] == [BASE_MODEL, "secret", "secret@1"]


def test_models_endpoint_and_delete_are_seen_at_once(env):
    with TestClient(env.app) as client:
        ids = [m["id"] for m in client.get("/v1/models", headers=bearer(USER_A)).json()["data"]]
        assert ids == [BASE_MODEL, "a", "b", "a@1", "a@2", "b@1"]
        assert resolve(env, USER_A, "b").served_model == "b@1"  # now cached for half a second
        assert client.delete("/v1/adapters/b", headers=bearer(ADMIN_A)).status_code == 200
        with pytest.raises(ModelNotFound):  # this replica's lookup cache was invalidated by the delete
            resolve(env, USER_A, "b")
