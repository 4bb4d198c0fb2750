"""PUT/GET/DELETE /v1/routes through the real controllers, config store and exception table."""

from __future__ import annotations

import json

import pytest
from api_env import ADMIN_A, ADMIN_B, USER_A, bearer, upload_files
from litestar.testing import TestClient

ROUTE = {"variants": [{"adapter": "a", "weight": 90}, {"adapter": "b@1", "weight": 10}], "sticky": "user"}


@pytest.fixture
def client(api_env, peft_adapters):
    """Tenant alpha has adapters `a` (v1) and `b` (v1); tenant beta has none."""
    env = api_env()
    with TestClient(env.app) as client:
        for name in ("a", "b"):
            response = client.post(
                "/v1/adapters",
                data={"name": name},
                files=upload_files(peft_adapters["qv"]),
                headers=bearer(ADMIN_A),
            )
            assert response.status_code == 201, response.text
        yield client


def put(client, name, body, key=ADMIN_A):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.put(
        f"/v1/routes/{name}", content=content, headers={**bearer(key), "content-type": "application/json"}
    )


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_put_get_list_delete(client):
    response = put(client, "support", ROUTE)
    assert response.status_code == 200, response.text
    assert response.json() == {"name": "support", **ROUTE}
    assert client.get("/v1/routes/support", headers=bearer(USER_A)).json() == {"name": "support", **ROUTE}

    replaced = {"variants": [{"adapter": "b", "weight": 1}], "sticky": "none"}
    assert put(client, "support", replaced).status_code == 200
    put(client, "another", ROUTE)
    listed = client.get("/v1/routes", headers=bearer(USER_A)).json()
    assert listed["object"] == "list"
    assert listed["data"] == [{"name": "another", **ROUTE}, {"name": "support", **replaced}]

    deleted = client.delete("/v1/routes/support", headers=bearer(ADMIN_A))
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert (
        error_of(client.get("/v1/routes/support", headers=bearer(ADMIN_A)), 404)["code"] == "route_not_found"
    )
    assert (
        error_of(client.delete("/v1/routes/support", headers=bearer(ADMIN_A)), 404)["code"]
        == "route_not_found"
    )


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        ({"variants": [{"adapter": "a", "weight": 0}]}, "variants[0].weight", "positive integer"),
        ({"variants": [{"adapter": "a", "weight": -5}]}, "variants[0].weight", "positive integer"),
        ({"variants": [{"adapter": "a", "weight": 1.5}]}, "variants[0].weight", "positive integer"),
        ({"variants": [{"adapter": "a", "weight": True}]}, "variants[0].weight", "positive integer"),
        ({"variants": [{"adapter": "a", "weight": "90"}]}, "variants[0].weight", "positive integer"),
        ({"variants": []}, "variants", "non-empty"),
        ({"variants": [{"adapter": "a", "weight": 1}], "sticky": "session"}, "sticky", "sticky"),
        (
            {"variants": [{"adapter": "a", "weight": 1}, {"adapter": "a", "weight": 2}]},
            "variants[1].adapter",
            "repeats",
        ),
        (
            {"variants": [{"adapter": "missing", "weight": 1}]},
            "variants[0].adapter",
            "not an adapter of this tenant",
        ),
        (
            {"variants": [{"adapter": "a", "weight": 1}, {"adapter": "b@7", "weight": 1}]},
            "variants[1].adapter",
            "b@7",
        ),
    ],
)
def test_invalid_routes_are_422_naming_the_field(client, body, field, fragment):
    error = error_of(put(client, "r", body), 422)
    assert error["code"] == "invalid_route" and error["param"] == field
    assert fragment in error["message"]
    assert error_of(client.get("/v1/routes/r", headers=bearer(ADMIN_A)), 404)["code"] == "route_not_found"


def test_malformed_json_and_bad_route_name_are_422(client):
    assert "not valid JSON" in error_of(put(client, "r", b"{not json"), 422)["message"]
    assert error_of(put(client, "bad@name", ROUTE), 422)["param"] == "name"


def test_user_key_403_unknown_key_401(client):
    assert error_of(put(client, "r", ROUTE, key=USER_A), 403)["code"] == "insufficient_permissions"
    put(client, "r", ROUTE)
    assert (
        error_of(client.delete("/v1/routes/r", headers=bearer(USER_A)), 403)["code"]
        == "insufficient_permissions"
    )
    assert error_of(client.get("/v1/routes", headers=bearer("sk-wrong")), 401)["code"] == "invalid_api_key"


def test_routes_are_isolated_per_tenant(client):
    put(client, "support", ROUTE)
    theirs = client.get("/v1/routes/support", headers=bearer(ADMIN_B))
    missing = client.get("/v1/routes/nothing", headers=bearer(ADMIN_B))
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["message"] == missing.json()["error"]["message"].replace(
        "nothing", "support"
    )
    assert client.get("/v1/routes", headers=bearer(ADMIN_B)).json()["data"] == []
    assert client.delete("/v1/routes/support", headers=bearer(ADMIN_B)).status_code == 404
    # Beta cannot point a route at alpha's adapter: it is not beta's.
    error = error_of(put(client, "steal", {"variants": [{"adapter": "a", "weight": 1}]}, key=ADMIN_B), 422)
    assert "not an adapter of this tenant" in error["message"]
    assert client.get("/v1/routes/support", headers=bearer(ADMIN_A)).status_code == 200
