"""The prefix cache never crosses tenants: `usage.prompt_tokens_details.cached_tokens` (what a caller can
see of the cache, timing aside) is 0 for another tenant's exact prompt, > 0 within a tenant, 0 again
for another `cache_salt` within it, and > 0 between tenants whose keys opt into one `cache_group`
(one key from the `--api-keys` file, one from the config store). Through the real app and engine."""

from __future__ import annotations

import pytest
from app_fixtures import make_text_model
from loraserve.tenancy import ApiKey, InvalidKeysFile, Principal, engine_cache_salt, hash_key, parse_api_keys
from test_inference_completions import run

KEYS = {
    "sk-alice": {"tenant": "alice", "role": "user"},
    "sk-bob": {"tenant": "bob", "role": "user"},
    "sk-dave": {"tenant": "dave", "role": "user", "cache_group": "support"},
}
# carol's key lives in the config store only (as an operator's tooling would put it there)
CAROL = ApiKey(key_hash=hash_key("sk-carol"), tenant="carol", cache_group="support")
PROMPT = list(range(20, 32))  # 12 tokens: 3 blocks of 4, of which 2 can hit (the last token is computed)
HIT = 8


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("cache-isolation") / "model")


def test_cached_tokens_never_cross_tenants_salts_or_groups(tmp_path, model_dir):
    async def scenario(client, services):
        await services.config_store.put_key(CAROL)

        async def cached(key, prompt=PROMPT, **extra) -> int:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
            response = await client.post("/v1/completions", json=body, headers=auth(key))
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        async def chat_cached(key, **extra) -> int:
            body = {
                "model": "tiny",
                "messages": [{"role": "system", "content": "You are the support bot of Acme."}],
                "max_tokens": 1,
                **extra,
            }
            response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        seen = {
            "alice first": await cached("sk-alice"),
            "bob, alice's exact prompt": await cached("sk-bob"),
            "alice again": await cached("sk-alice"),
            "alice, salt s1": await cached("sk-alice", cache_salt="s1"),
            "alice, salt s1 again": await cached("sk-alice", cache_salt="s1"),
            "bob, salt s1": await cached("sk-bob", cache_salt="s1"),  # a salt never widens sharing
            "alice, salt s2": await cached("sk-alice", cache_salt="s2"),
            "carol (group), first": await cached("sk-carol"),
            "dave (group), after carol": await cached("sk-dave"),
            "dave, salt s1": await cached("sk-dave", cache_salt="s1"),
            "carol, salt s1 after dave": await cached("sk-carol", cache_salt="s1"),
            "bob again": await cached("sk-bob"),
            "chat alice": await chat_cached("sk-alice"),
            "chat bob": await chat_cached("sk-bob"),
            "chat alice again": await chat_cached("sk-alice"),
            "chat dave": await chat_cached("sk-dave"),
            "chat carol after dave": await chat_cached("sk-carol"),
        }
        empty_salt = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "cache_salt": ""},
            headers=auth("sk-alice"),
        )
        number_salt = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "cache_salt": 3},
            headers=auth("sk-alice"),
        )
        return seen, empty_salt, number_salt

    seen, empty_salt, number_salt = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert seen == {
        "alice first": 0,
        "bob, alice's exact prompt": 0,
        "alice again": HIT,
        "alice, salt s1": 0,
        "alice, salt s1 again": HIT,
        "bob, salt s1": 0,
        "alice, salt s2": 0,
        "carol (group), first": 0,
        "dave (group), after carol": HIT,
        "dave, salt s1": 0,
        "carol, salt s1 after dave": HIT,
        "bob again": HIT,
        "chat alice": 0,
        "chat bob": 0,
        "chat alice again": seen["chat alice again"],
        "chat dave": 0,
        "chat carol after dave": seen["chat carol after dave"],
    }
    assert seen["chat alice again"] > 0 and seen["chat carol after dave"] == seen["chat alice again"]
    for response in (empty_salt, number_salt):
        assert response.status_code == 400, response.text
        assert "cache_salt" in response.json()["error"]["message"]


def test_the_engine_salt_is_the_scope_and_the_request_salt_and_nothing_spells_another():
    alice = Principal(tenant="alice", role="user")
    grouped = Principal(tenant="alice", role="user", cache_group="alice")
    other_member = Principal(tenant="bob", role="admin", cache_group="alice")
    salts = {
        engine_cache_salt(alice),
        engine_cache_salt(alice, "s"),
        engine_cache_salt(grouped),  # a group named like a tenant is still not that tenant
        engine_cache_salt(Principal(tenant="bob", role="user")),
        engine_cache_salt(alice, 's",null'),  # JSON escaping: no request salt can forge a scope
        engine_cache_salt(alice, "null"),
    }
    assert len(salts) == 6
    assert engine_cache_salt(grouped, "s") == engine_cache_salt(other_member, "s")


def test_keys_file_reads_and_checks_cache_group():
    (key,) = parse_api_keys({"sk-x": {"tenant": "acme", "cache_group": "shared-prompts"}})
    assert Principal.from_key(key).cache_group == "shared-prompts"
    (plain,) = parse_api_keys({"sk-y": {"tenant": "acme"}})
    assert plain.cache_group is None
    for bad in ("", "a b", "../x", 7, "x" * 65):
        with pytest.raises(InvalidKeysFile, match="cache_group"):
            parse_api_keys({"sk-z": {"tenant": "acme", "cache_group": bad}})
