"""`merged_adapters` in requests and `merge` route variants: the refusals (400 naming the field), tenant
isolation (another tenant's adapter answers like a missing one), one cached merge per spec, and, through
the real app and engine, greedy tokens equal to PEFT's add_weighted_adapter on the same adapters."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from api_env import ADMIN_A, ADMIN_B, BASE_MODEL, USER_A, bearer, tiny_shape, upload
from app_fixtures import make_text_model, open_test_services
from factories import load_peft_reference, make_adapter, reference_greedy
from litestar.testing import TestClient
from loraserve.app import create_app
from loraserve.merges.fields import MergedAdapters
from loraserve.merges.service import Merges
from loraserve.resolution import ModelNotFound, resolve_model
from loraserve.settings import ServerSettings

from adapter_format.names import parse_merge_id


@pytest.fixture
def env(api_env, peft_adapters, tmp_path):
    """Alpha has `a` (rank 8), `b` (rank 8) and `c` (rank 4); beta has `secret` (rank 8)."""
    env = api_env()
    env.services.merges = Merges(tmp_path / "merges", tiny_shape(), 16, BASE_MODEL)
    with TestClient(env.app) as client:
        for name, folder in (("a", "qv"), ("b", "qv"), ("c", "all")):
            assert upload(client, name, peft_adapters[folder]).status_code == 201
        assert upload(client, "secret", peft_adapters["qv"], key=ADMIN_B).status_code == 201
        env.client = client
        yield env


def resolve(env, key, merged, model=BASE_MODEL):
    return asyncio.run(
        resolve_model(env.services, env.principals[key], model, None, MergedAdapters(**merged))
    )


def completion(client, merged, model=BASE_MODEL, key=USER_A):
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "merged_adapters": merged}
    return client.post("/v1/completions", json=body, headers=bearer(key))


def test_a_merge_is_computed_once_per_spec_and_scoped_to_its_tenant(env, tmp_path):
    spec = {"ids": ["a", "b@1"], "weights": [0.7, 0.3], "merge_strategy": "ties", "density": 0.5}
    first = resolve(env, USER_A, spec)
    assert first.kind == "merge" and first.served_model == "ties:a@1*0.7+b@1*0.3"
    tenant, key = parse_merge_id(first.engine_adapter_id)
    assert tenant == "alpha"
    folder = tmp_path / "merges" / "alpha" / key
    assert (folder / "adapter_model.safetensors").is_file()
    written = (folder / "adapter_model.safetensors").stat().st_mtime_ns
    again = resolve(env, USER_A, {**spec, "ids": ["alpha/a@1", "b"]})  # the same versions, written otherwise
    assert again.engine_adapter_id == first.engine_adapter_id
    assert (folder / "adapter_model.safetensors").stat().st_mtime_ns == written  # not merged again
    others = [
        {**spec, "weights": [0.3, 0.7]},
        {**spec, "density": 0.6},
        {**spec, "majority_sign_method": "frequency"},
        {**spec, "merge_strategy": "dare_ties"},
        {**spec, "ids": ["b", "a"]},
        {"ids": ["a", "b"], "weights": [0.7, 0.3]},
    ]
    ids = {resolve(env, USER_A, other).engine_adapter_id for other in others}
    assert len(ids) == len(others) and first.engine_adapter_id not in ids


def test_another_tenants_adapter_answers_like_a_missing_one(env):
    missing = completion(env.client, {"ids": ["a", "nothing"]})
    foreign = completion(env.client, {"ids": ["a", "secret"]})
    qualified = completion(env.client, {"ids": ["a", "beta/secret"]})
    for response, name in ((missing, "nothing"), (foreign, "secret"), (qualified, "beta/secret")):
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "merged_adapters.ids[1]"
        assert error["message"] == (
            f"merged_adapters.ids[1]: the adapter {name!r} does not exist; name one of your adapters "
            "(name or name@version)"
        )
    with pytest.raises(ModelNotFound):  # beta cannot reach alpha's either way
        resolve(env, ADMIN_B, {"ids": ["secret", "alpha/a"]})
    assert (
        resolve(env, ADMIN_B, {"ids": ["secret", "beta/secret@1"], "merge_strategy": "cat"}).kind == "merge"
    )


@pytest.mark.parametrize(
    ("merged", "param", "fragment"),
    [
        (
            {"ids": ["a", "b"], "merge_strategy": "svd"},
            "merged_adapters.merge_strategy",
            "not a merge method",
        ),
        ({"ids": ["a", "b"], "weights": [1.0]}, "merged_adapters.weights", "1 entries for 2 adapters"),
        ({"ids": []}, "merged_adapters.ids", "1 to 8"),
        ({"ids": [f"x{i}" for i in range(9)]}, "merged_adapters.ids", "1 to 8"),
        ({"ids": ["a", "a"]}, "merged_adapters.ids[1]", "listed twice"),
        ({"ids": ["a", "bad name"]}, "merged_adapters.ids[1]", "invalid"),
        ({"ids": ["a", "b"], "merge_strategy": "ties"}, "merged_adapters.density", "required"),
        ({"ids": ["a", "b"], "merge_strategy": "ties", "density": 0}, "merged_adapters.density", "(0, 1]"),
        (
            {"ids": ["a", "b"], "merge_strategy": "dare_linear", "density": 1.5},
            "merged_adapters.density",
            "(0, 1]",
        ),
        ({"ids": ["a", "b"], "density": 0.5}, "merged_adapters.density", "only"),
        (
            {
                "ids": ["a", "b"],
                "merge_strategy": "dare_linear",
                "density": 0.5,
                "majority_sign_method": "total",
            },
            "merged_adapters.majority_sign_method",
            "only",
        ),
        (
            {"ids": ["a", "b"], "merge_strategy": "ties", "density": 0.5, "majority_sign_method": "mean"},
            "merged_adapters.majority_sign_method",
            "total, frequency",
        ),
        ({"ids": ["a", "b"], "weights": [1.0, 1e9]}, "merged_adapters.weights[1]", "finite"),
        ({"ids": ["a", "c"]}, "merged_adapters", "a@1 (r=8), c@1 (r=4); use cat"),
        ({"ids": ["a", "b", "c"], "merge_strategy": "cat"}, "merged_adapters", "8 + 8 + 4 = 20"),
    ],
)
def test_bad_merges_are_400_naming_the_field(env, merged, param, fragment):
    response = completion(env.client, merged)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]


def test_merged_adapters_need_the_base_model_and_known_fields(env):
    response = completion(env.client, {"ids": ["a"]}, model="a")
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    response = completion(env.client, {"ids": ["a"], "strategy": "ties"})
    assert response.status_code == 400 and "strategy" in response.text
    response = completion(env.client, {"ids": ["a"], "weights": ["x"]})
    assert response.status_code == 400


def put_route(client, name, variants, key=ADMIN_A):
    return client.put(
        f"/v1/routes/{name}",
        content=json.dumps({"variants": variants, "sticky": "none"}),
        headers={**bearer(key), "content-type": "application/json"},
    )


def test_route_merge_variants(env):
    merge = {"ids": ["a", "b"], "weights": [0.5, 0.5], "merge_strategy": "dare_linear", "density": 0.7}
    variants = [{"adapter": "a", "weight": 1}, {"merge": merge, "weight": 1}]
    response = put_route(env.client, "ab", variants)
    assert response.status_code == 200, response.text
    assert response.json()["variants"] == variants
    picked = {asyncio.run(resolve_model(env.services, env.principals[USER_A], "ab", None)) for _ in range(40)}
    assert {(p.kind, p.variant) for p in picked} == {("route", "a"), ("route", "merge:a+b")}
    [merged] = [p for p in picked if p.variant == "merge:a+b"]
    assert merged.engine_adapter_id == resolve(env, USER_A, merge).engine_adapter_id  # the request's merge
    assert merged.served_model == "dare_linear:a@1*0.5+b@1*0.5"
    # refused when stored: parts that cannot be merged, missing parts and another tenant's, both forms
    for bad, field, fragment in (
        ({"ids": ["a", "c"]}, "variants[1].merge", "one rank only"),
        ({"ids": ["a", "secret"]}, "variants[1].merge.ids[1]", "does not exist"),
        ({"ids": ["a", "nothing"]}, "variants[1].merge.ids[1]", "does not exist"),
        ({"ids": ["a", "b"], "density": 0.5}, "variants[1].merge.density", "only"),
    ):
        response = put_route(env.client, "bad", [{"adapter": "a", "weight": 1}, {"merge": bad, "weight": 1}])
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"] == field and fragment in response.json()["error"]["message"]
    response = put_route(env.client, "both", [{"adapter": "a", "merge": merge, "weight": 1}])
    assert response.status_code == 422 and "not both" in response.text
    # a version a merge variant needs cannot be deleted while the route names it
    deleted = env.client.delete("/v1/adapters/b@1", headers=bearer(ADMIN_A))
    assert deleted.status_code == 409 and "ab" in deleted.text


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("merged-api")
    model_dir = make_text_model(root / "model")
    adapters = {
        "pirate": make_adapter(
            model_dir, root / "pirate", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        ),
        "robot": make_adapter(
            model_dir, root / "robot", seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"]
        ),
    }
    return model_dir, adapters


def test_served_merge_equals_peft_and_a_route_serves_it(tmp_path, text_model):
    model_dir, adapters = text_model
    prompt = [5, 17, 42, 99, 7]
    merge = {"ids": ["pirate", "robot"], "weights": [1.0, 0.6], "merge_strategy": "ties", "density": 0.5}
    peft = load_peft_reference(model_dir, adapters)
    peft.add_weighted_adapter(
        list(adapters), merge["weights"], "merged", combination_type="ties", density=0.5
    )
    expected = reference_greedy(peft, prompt, "merged", 8)
    assert expected != reference_greedy(peft, prompt, "pirate", 8)

    async def scenario(client, services):
        for name, folder in adapters.items():
            services.adapter_store.put("default", name, folder)
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        direct = await client.post("/v1/completions", json={**body, "merged_adapters": merge})
        route = await client.put("/v1/routes/exp", json={"variants": [{"merge": merge, "weight": 1}]})
        assert route.status_code == 200, route.text
        routed = await client.post("/v1/completions", json={**body, "model": "exp"})
        chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}
        chatted = await client.post("/v1/chat/completions", json={**chat, "merged_adapters": merge})
        assert chatted.status_code == 200 and chatted.json()["model"] == "ties:pirate@1*1+robot@1*0.6"
        return direct, routed, services.engine.stats(), services.metrics.render().decode()

    direct, routed, stats, metrics = asyncio.run(_serve(tmp_path, model_dir, scenario))
    assert direct.status_code == 200, direct.text
    assert direct.json()["model"] == direct.headers["x-loraserve-variant"] == "ties:pirate@1*1+robot@1*0.6"
    assert direct.json()["choices"][0]["token_ids"] == expected
    assert routed.status_code == 200 and routed.json()["choices"][0]["token_ids"] == expected
    assert routed.headers["x-loraserve-variant"] == "ties:pirate@1*1+robot@1*0.6"
    merged_ids = [a for a in stats.resident_adapters if parse_merge_id(a)]
    assert len(merged_ids) == 1 and merged_ids[0].startswith("default/merge+")  # one adapter, counted
    _, key = parse_merge_id(merged_ids[0])
    assert (
        f'loraserve_adapter_resident{{adapter="merge+{key}",tenant="default",tier="gpu",version="0"}} 1.0'
        in metrics
    )


async def _serve(tmp_path, model_dir, scenario):
    async with open_test_services(tmp_path, model_dir) as services:
        app = create_app(ServerSettings(), services=services)
        async with (
            app.lifespan(),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client,
        ):
            return await scenario(client, services)


def test_the_merge_directory_keeps_the_most_recently_used(env, tmp_path):
    env.services.merges = Merges(tmp_path / "few", tiny_shape(), 16, BASE_MODEL, max_cached=1)

    def folder_of(weights):
        _, key = parse_merge_id(
            resolve(env, USER_A, {"ids": ["a", "b"], "weights": weights}).engine_adapter_id
        )
        return tmp_path / "few" / "alpha" / key

    old, recent = folder_of([1.0, 1.0]), folder_of([1.0, 0.5])
    assert old.is_dir() and recent.is_dir()  # both used within MIN_AGE_S: neither is dropped yet
    os.utime(old, (0, 0))  # long unused
    newest = folder_of([0.5, 1.0])
    assert not old.exists() and recent.is_dir() and newest.is_dir()
    assert folder_of([1.0, 1.0]) == old and old.is_dir()  # asked again: merged again
