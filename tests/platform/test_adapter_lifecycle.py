"""Adapter lifecycle over HTTP: names that cannot be taken, versions a route still needs, a new version
serving at once. Conflicts are 409 with OpenAI's error body, and a refused call changes nothing."""

from __future__ import annotations

import asyncio
import json

import pytest
from api_env import ADMIN_A, ADMIN_B, BASE_MODEL, USER_A, bearer, upload
from litestar.testing import TestClient
from loraserve.resolution import resolve_model
from loraserve.routing import Route, Variant
from loraserve.routing.in_use import variants_needing


@pytest.fixture
def env(api_env):
    return api_env()


@pytest.fixture
def client(env):
    with TestClient(env.app) as client:
        yield client


def put_route(client, name, variants, key=ADMIN_A):
    body = {"variants": [{"adapter": a, "weight": w} for a, w in variants]}
    return client.put(
        f"/v1/routes/{name}",
        content=json.dumps(body),
        headers={**bearer(key), "content-type": "application/json"},
    )


def conflict(response, code) -> str:
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    return error["message"]


def model_ids(client, key=USER_A) -> list[str]:
    return [m["id"] for m in client.get("/v1/models", headers=bearer(key)).json()["data"]]


def test_the_base_model_name_cannot_be_taken(client, peft_adapters):
    message = conflict(upload(client, BASE_MODEL, peft_adapters["qv"]), "name_conflict")
    assert BASE_MODEL in message and "base model" in message
    assert client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"] == []
    assert upload(client, "bot", peft_adapters["qv"]).status_code == 201
    message = conflict(put_route(client, BASE_MODEL, [("bot", 1)]), "name_conflict")
    assert BASE_MODEL in message
    assert client.get("/v1/routes", headers=bearer(ADMIN_A)).json()["data"] == []
    assert model_ids(client) == [BASE_MODEL, "bot", "bot@1"]


def test_a_route_named_like_an_adapter_takes_the_name_and_models_lists_it_once(client, peft_adapters):
    assert upload(client, "support", peft_adapters["qv"]).status_code == 201
    assert upload(client, "other", peft_adapters["qv"]).status_code == 201
    assert put_route(client, "support", [("other", 1)]).status_code == 200
    # The reverse order is the same: an upload may share a route's name (reachable as name@version).
    assert upload(client, "other-route", peft_adapters["qv"]).status_code == 201
    ids = model_ids(client)
    assert sorted(ids) == sorted(set(ids)), "no name listed twice"
    assert ids.count("support") == 1 and "support@1" in ids


@pytest.mark.parametrize(
    ("variants", "deleted", "remaining", "broken"),
    [
        (["bot@1"], [1], [2], [("r", "bot@1")]),
        (["bot@2"], [1], [2], []),
        (["bot"], [2], [1], []),  # the latest goes, an older one still serves the bare name
        (["bot"], [1], [], [("r", "bot")]),  # the last version goes
        (["bot", "bot@1"], [1, 2], [], [("r", "bot"), ("r", "bot@1")]),
        (["botany@1", "bot-2"], [1], [], []),  # other names, even with the same prefix
    ],
)
def test_variants_needing(variants, deleted, remaining, broken):
    route = Route(name="r", variants=tuple(Variant(adapter=v, weight=1) for v in variants))
    assert variants_needing([route], "bot", deleted, remaining) == broken


def test_deleting_a_version_a_route_uses_is_409_naming_the_route(client, env, peft_adapters):
    for folder in (peft_adapters["qv"], peft_adapters["all"]):
        assert upload(client, "support-bot", folder).status_code == 201
    assert put_route(client, "support", [("support-bot@1", 1)]).status_code == 200
    h = bearer(ADMIN_A)
    message = conflict(client.delete("/v1/adapters/support-bot@1", headers=h), "adapter_in_use")
    assert "route 'support'" in message and "support-bot@1" in message
    conflict(client.delete("/v1/adapters/support-bot", headers=h), "adapter_in_use")
    assert env.engine.forgotten == []
    versions = client.get("/v1/adapters/support-bot", headers=h).json()["versions"]
    assert [v["version"] for v in versions] == [1, 2], "a refused delete deletes nothing"
    # Version 2 is not in the route: it goes.
    assert client.delete("/v1/adapters/support-bot@2", headers=h).status_code == 200
    assert client.delete("/v1/routes/support", headers=h).status_code == 200
    assert client.delete("/v1/adapters/support-bot@1", headers=h).status_code == 200


def test_a_bare_name_route_blocks_deleting_the_last_version_only(client, peft_adapters):
    for folder in (peft_adapters["qv"], peft_adapters["all"]):
        upload(client, "bot", folder)
    assert put_route(client, "chat", [("bot", 1)]).status_code == 200
    h = bearer(ADMIN_A)
    assert client.delete("/v1/adapters/bot@2", headers=h).status_code == 200  # bot@1 now serves `bot`
    message = conflict(client.delete("/v1/adapters/bot@1", headers=h), "adapter_in_use")
    assert "route 'chat' (variant 'bot')" in message
    conflict(client.delete("/v1/adapters/bot", headers=h), "adapter_in_use")
    assert [a["name"] for a in client.get("/v1/adapters", headers=h).json()["data"]] == ["bot"]


def test_another_tenants_routes_neither_block_nor_show(client, peft_adapters):
    upload(client, "bot", peft_adapters["qv"], key=ADMIN_A)
    upload(client, "bot", peft_adapters["qv"], key=ADMIN_B)
    assert put_route(client, "beta-secret-route", [("bot", 1)], key=ADMIN_B).status_code == 200
    assert client.delete("/v1/adapters/bot", headers=bearer(ADMIN_A)).status_code == 200
    message = conflict(client.delete("/v1/adapters/bot", headers=bearer(ADMIN_B)), "adapter_in_use")
    assert "beta-secret-route" in message


def test_a_new_version_serves_new_requests_at_once(client, env, peft_adapters):
    upload(client, "bot", peft_adapters["qv"])
    put_route(client, "chat", [("bot", 1)])

    def served(model):
        principal = env.principals[USER_A]
        return asyncio.run(resolve_model(env.services, principal, model, "u1")).served_model

    assert (served("bot"), served("chat")) == ("bot@1", "bot@1")  # both now in the lookup cache
    assert upload(client, "bot", peft_adapters["all"]).json()["version"] == 2
    assert (served("bot"), served("chat")) == ("bot@2", "bot@2")


def test_names_taken_before_the_rule_are_listed_once(client, env, peft_adapters):
    env.services.adapter_store.put("alpha", BASE_MODEL, peft_adapters["qv"])  # behind the API's back
    route = Route(name=BASE_MODEL, variants=(Variant(adapter=f"{BASE_MODEL}@1", weight=1),))
    asyncio.run(env.services.config_store.put_route("alpha", route))
    ids = model_ids(client)
    assert ids.count(BASE_MODEL) == 1 and f"{BASE_MODEL}@1" in ids
