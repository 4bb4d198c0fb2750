"""The browsable API schema: served without a key, free of tenant data, and in step with docs/API*.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from api_env import ADMIN_A, BASE_MODEL, bearer, upload_files
from litestar.testing import TestClient

DOCS = Path(__file__).resolve().parents[2] / "docs"
# "POST /v1/completions", "DELETE /v1/adapters/{name}@{version}" in the text of the API docs.
ENDPOINT = re.compile(r"\b(GET|POST|PUT|DELETE|PATCH) (/[A-Za-z0-9_/{}@.-]*[A-Za-z0-9_}])")


def _normalised(path: str) -> str:
    """Path parameters named alike: `/v1/adapters/{name}@{version}` and `{ref}` are one path."""
    return re.sub(r"\{[^}]*\}(@\{[^}]*\})?", "{}", path)


def documented_endpoints() -> set[tuple[str, str]]:
    text = (DOCS / "API.md").read_text() + (DOCS / "API_ADMIN.md").read_text()
    return {(method, _normalised(path)) for method, path in ENDPOINT.findall(text)}


@pytest.fixture
def client(api_env, peft_adapters):
    env = api_env()
    with TestClient(env.app) as client:
        # A tenant with an adapter and a route: none of it may show in the schema.
        response = client.post(
            "/v1/adapters",
            data={"name": "secret-bot"},
            files=upload_files(peft_adapters["qv"]),
            headers=bearer(ADMIN_A),
        )
        assert response.status_code == 201, response.text
        response = client.put(
            "/v1/routes/secret-route",
            json={"variants": [{"adapter": "secret-bot", "weight": 1}]},
            headers=bearer(ADMIN_A),
        )
        assert response.status_code == 200, response.text
        yield client


def test_schema_and_ui_need_no_key_and_show_no_tenant_data(client):
    schema = client.get("/schema/openapi.json")
    assert schema.status_code == 200
    assert schema.json()["openapi"].startswith("3.")
    for path in ("/schema", "/schema/redoc", "/schema/openapi.yaml"):
        assert client.get(path).status_code == 200, path
    assert "swagger" in client.get("/schema").text.lower()
    for secret in (
        "secret-bot",
        "secret-route",
        ADMIN_A,
        BASE_MODEL,
    ):  # (the tenant, "alpha", is a field name too)
        assert secret not in schema.text


def test_every_operation_has_a_tag_and_a_summary(client):
    paths = client.get("/schema/openapi.json").json()["paths"]
    operations = [(m, p, op) for p, item in paths.items() for m, op in item.items()]
    assert operations
    missing = [f"{m.upper()} {p}" for m, p, op in operations if not op.get("tags") or not op.get("summary")]
    assert missing == []
    # Tenant endpoints declare the bearer key; the probes do not.
    assert paths["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in paths["/health"]["get"]


def test_docs_and_schema_list_the_same_endpoints(client):
    """Every operation of the schema is documented, and every documented `METHOD /path` (a template like
    `/v1/routes/{name}` or an example like `/v1/routes/support`) is an operation of the schema."""
    paths = client.get("/schema/openapi.json").json()["paths"]
    operations = {(method.upper(), _normalised(path)) for path, item in paths.items() for method in item}
    documented = documented_endpoints()

    def matches(operation, doc):
        pattern = re.escape(operation[1]).replace(re.escape("{}"), r"[^/]+")
        return operation[0] == doc[0] and (doc[1] == operation[1] or re.fullmatch(pattern, doc[1]))

    undocumented = sorted(op for op in operations if not any(matches(op, doc) for doc in documented))
    unknown = sorted(doc for doc in documented if not any(matches(op, doc) for op in operations))
    assert undocumented == [], "endpoints missing from docs/API.md or docs/API_ADMIN.md"
    assert unknown == [], "documented endpoints the server does not have"


def test_every_endpoint_that_authenticates_declares_the_key(client):
    """An endpoint whose handler takes the caller (`principal`) says so in the schema; the others do not."""
    paths = client.get("/schema/openapi.json").json()["paths"]
    app = client.app
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            if not handler.include_in_schema or route.path.startswith("/schema"):
                continue
            path = re.sub(r":[a-z]+\}", "}", route.path)
            for method in handler.http_methods:
                operation = paths[path][method.lower()]
                authenticates = "principal" in handler.parsed_fn_signature.parameters
                assert ("security" in operation) == authenticates, f"{method} {path}"


def test_the_pages_load_only_this_servers_assets(client):
    """No CDN: every script, style and icon of the UIs is this server's (tests/platform/
    test_openapi_browser.py renders them in a browser), and the assets are served with a cache header."""
    for page in ("/schema", "/schema/swagger", "/schema/redoc"):
        html = client.get(page).text
        links = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
        assert links and all(link.startswith(("/schema/assets/", "data:")) for link in links), (page, links)
        assert "Content-Security-Policy" in html and "default-src 'self'" in html
        for link in links:
            if link.startswith("/schema/assets/"):
                asset = client.get(link)
                assert asset.status_code == 200 and asset.content, link
                assert "max-age" in asset.headers["cache-control"]
    assert client.get("/schema/assets/openapi.py").status_code == 404
    assert client.get("/schema/assets/..%2Fopenapi.py").status_code == 404


def test_asset_links_carry_the_root_path(api_env):
    """Behind a proxy that strips --root-path, the browser asks for /prefix/schema/assets/...."""
    from litestar.testing import TestClient

    env = api_env()
    with TestClient(env.app, root_path="/llm") as client:
        html = client.get("/schema").text
    assert "/llm/schema/assets/swagger-ui-bundle.js" in html
