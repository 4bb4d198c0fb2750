"""Tenancy: keys files, hashing, 401/403, open mode, names, and per-tenant concurrency limits."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from loraserve.config_store import EmbeddedConfigStore
from loraserve.errors import status_and_code
from loraserve.tenancy import (
    DEFAULT_TENANT,
    ApiKey,
    Authenticator,
    ConcurrencyLimiter,
    Forbidden,
    InvalidKeysFile,
    InvalidName,
    Principal,
    TooManyRequests,
    Unauthorized,
    check_name,
    hash_key,
    load_api_keys,
    parse_bearer,
    require_admin,
)

KEYS = {
    "sk-alice-admin": {"tenant": "alice", "role": "admin", "max_concurrent_requests": 3},
    "sk-bob-user": {"tenant": "bob", "role": "user"},
}
YAML_KEYS = """\
sk-alice-admin:
  tenant: alice
  role: admin
  max_concurrent_requests: 3
sk-bob-user: {tenant: bob, role: user}
"""


def authenticate(auth: Authenticator, header: str | None) -> Principal:
    return asyncio.run(auth.authenticate(header))


@pytest.fixture
def file_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return load_api_keys(path)


# keys files


@pytest.mark.parametrize(
    "file_name, text",
    [
        ("keys.json", json.dumps(KEYS)),
        ("keys.yaml", YAML_KEYS),
        ("keys.yml", YAML_KEYS),
        ("keys.conf", YAML_KEYS),
    ],
)
def test_keys_file_json_and_yaml(tmp_path, file_name, text):
    path = tmp_path / file_name
    path.write_text(text)
    keys = load_api_keys(path)
    assert keys == [
        ApiKey(key_hash=hash_key("sk-alice-admin"), tenant="alice", role="admin", max_concurrent_requests=3),
        ApiKey(key_hash=hash_key("sk-bob-user"), tenant="bob", role="user"),
    ]


def test_keys_are_kept_as_sha256_hashes(file_keys):
    assert file_keys[1].key_hash == hashlib.sha256(b"sk-bob-user").hexdigest()
    assert all(len(k.key_hash) == 64 and "sk-" not in repr(k) for k in file_keys)


@pytest.mark.parametrize(
    "content, message",
    [
        ("[]", "non-empty mapping"),
        ("{}", "non-empty mapping"),
        ('{"sk-x": "alice"}', "entry 1: settings must be a mapping"),
        ('{"sk-x": {"role": "admin"}}', "entry 1: tenant must be a string"),
        ('{"sk-x": {"tenant": "a/b"}}', "entry 1: tenant 'a/b' contains a path separator"),
        ('{"sk-x": {"tenant": "a", "role": "root"}}', "role must be 'admin' or 'user'"),
        ('{"sk-x": {"tenant": "a", "max_concurrent_requests": 0}}', "positive integer"),
        ('{"sk-x": {"tenant": "a", "max_concurrent_requests": true}}', "positive integer"),
        ('{"sk-x": {"tenant": "a", "max_concurrent": 2}}', "unknown field(s) ['max_concurrent']"),
        ('{"sk x": {"tenant": "a"}}', "without whitespace"),
        ('{"": {"tenant": "a"}}', "without whitespace"),
        ('{"sk-secret": {"tenant": "a"}, "sk-2": {"tenant": ""}}', "entry 2: tenant is empty"),
        ("{not json: [", "not valid JSON or YAML"),
    ],
)
def test_bad_keys_files_say_what_is_wrong_without_showing_keys(tmp_path, content, message):
    path = tmp_path / "keys.json" if content.startswith("{not") else tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(InvalidKeysFile) as excinfo:
        load_api_keys(path)
    assert message in str(excinfo.value)
    assert "sk-secret" not in str(excinfo.value) and "sk-x" not in str(excinfo.value)


def test_missing_keys_file(tmp_path):
    with pytest.raises(InvalidKeysFile, match="cannot read API keys file"):
        load_api_keys(tmp_path / "nope.yaml")


# authentication


def test_known_keys_map_to_their_principal(file_keys):
    auth = Authenticator(file_keys)
    assert not auth.open_mode
    alice = authenticate(auth, "Bearer sk-alice-admin")
    assert (alice.tenant, alice.role, alice.max_concurrent, alice.is_admin) == ("alice", "admin", 3, True)
    assert alice.key_id == hash_key("sk-alice-admin")[:12]
    bob = authenticate(auth, "bearer   sk-bob-user ")
    assert (bob.tenant, bob.role, bob.max_concurrent) == ("bob", "user", None)


@pytest.mark.parametrize(
    "header, message",
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("   ", "missing API key"),
        ("sk-alice-admin", "malformed"),
        ("Basic c2stYWxpY2UtYWRtaW4=", "malformed"),
        ("Bearer", "malformed"),
        ("Bearer ", "malformed"),
        ("Bearer sk-alice-admin extra", "malformed"),
        ("Bearer sk-unknown", "invalid API key"),
        ("Bearer SK-ALICE-ADMIN", "invalid API key"),
    ],
)
def test_unauthorized(file_keys, header, message):
    with pytest.raises(Unauthorized, match=message) as excinfo:
        authenticate(Authenticator(file_keys), header)
    assert status_and_code(excinfo.value) == (401, "invalid_api_key")
    assert "Authorization: Bearer" in str(excinfo.value)


def test_user_key_on_admin_call_is_forbidden(file_keys):
    auth = Authenticator(file_keys)
    assert require_admin(authenticate(auth, "Bearer sk-alice-admin")).tenant == "alice"
    with pytest.raises(Forbidden, match="needs an admin key") as excinfo:
        require_admin(authenticate(auth, "Bearer sk-bob-user"))
    assert status_and_code(excinfo.value) == (403, "insufficient_permissions")


def test_open_mode_without_any_key():
    auth = Authenticator()
    assert auth.open_mode
    for header in (None, "Bearer anything", "garbage"):
        principal = authenticate(auth, header)
        assert (principal.tenant, principal.role) == (DEFAULT_TENANT, "admin")


def test_keys_from_the_config_store(tmp_path, file_keys):
    async def scenario():
        store = EmbeddedConfigStore(tmp_path)
        auth = await Authenticator.create(store=store)
        assert auth.open_mode  # nothing anywhere yet
        await store.put_key(
            ApiKey(key_hash=hash_key("sk-carol"), tenant="carol", role="user", max_concurrent_requests=2)
        )
        # a key appearing in the store closes open mode at once
        with pytest.raises(Unauthorized):
            await auth.authenticate(None)
        assert not auth.open_mode
        carol = await auth.authenticate("Bearer sk-carol")
        assert (carol.tenant, carol.role, carol.max_concurrent) == ("carol", "user", 2)
        await store.delete_key(hash_key("sk-carol"))
        with pytest.raises(Unauthorized):  # deleting every key never reopens the server
            await auth.authenticate("Bearer sk-carol")
        assert not auth.open_mode

        both = await Authenticator.create(file_keys, store=store)
        await store.put_key(ApiKey(key_hash=hash_key("sk-dave"), tenant="dave", role="admin"))
        assert (await both.authenticate("Bearer sk-dave")).tenant == "dave"
        assert (await both.authenticate("Bearer sk-alice-admin")).tenant == "alice"

    asyncio.run(scenario())


def test_parse_bearer():
    assert parse_bearer("Bearer abc") == "abc"
    assert parse_bearer("BEARER  abc  ") == "abc"


# names


@pytest.mark.parametrize("name", ["a", "A1", "my-adapter_v2.1", "x" * 64, "0"])
def test_valid_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "empty"),
        ("x" * 65, "65 characters"),
        ("a@2", "contains '@'"),
        ("a..b", "contains '..'"),
        (".hidden", "invalid"),
        ("-dash", "invalid"),
        ("a/b", "path separator"),
        ("a b", "invalid"),
        ("é", "invalid"),
        (7, "must be a string"),
    ],
)
def test_invalid_names(name, message):
    with pytest.raises(InvalidName, match=message):
        check_name(name, "route name")


# concurrency limits


def principal(tenant: str, limit: int | None = None) -> Principal:
    return Principal(tenant=tenant, role="user", max_concurrent=limit)


def test_limit_429_with_retry_after_and_release_on_exit():
    async def scenario():
        limiter = ConcurrencyLimiter(default_max_concurrent=2)
        alice = principal("alice")
        async with limiter.acquire(alice), limiter.acquire(alice):
            assert limiter.in_flight("alice") == 2
            with pytest.raises(TooManyRequests, match="limit is 2") as excinfo:
                async with limiter.acquire(alice):
                    pass
            assert (
                status_and_code(excinfo.value) == (429, "rate_limit_exceeded")
                and excinfo.value.retry_after_s >= 1
            )
            async with limiter.acquire(principal("bob")):  # other tenants are unaffected
                assert limiter.in_flight("bob") == 1
        assert limiter.in_flight("alice") == 0
        async with limiter.acquire(alice):
            pass

    asyncio.run(scenario())


def test_slot_released_when_the_request_fails():
    async def scenario():
        limiter = ConcurrencyLimiter(default_max_concurrent=1)
        with pytest.raises(RuntimeError):
            async with limiter.acquire(principal("alice")):
                raise RuntimeError("engine error")
        assert limiter.in_flight("alice") == 0
        task = asyncio.create_task(_hold(limiter, principal("alice")))
        await asyncio.sleep(0.01)
        assert limiter.in_flight("alice") == 1
        task.cancel()  # a client that disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        assert limiter.in_flight("alice") == 0

    asyncio.run(scenario())


async def _hold(limiter: ConcurrencyLimiter, who: Principal) -> None:
    async with limiter.acquire(who):
        await asyncio.sleep(10)


def test_per_key_override_and_unlimited_default():
    async def scenario():
        limiter = ConcurrencyLimiter()  # no default: unlimited unless the key says otherwise
        leases = [limiter.try_acquire(principal("alice")) for _ in range(50)]
        assert limiter.in_flight("alice") == 50
        for lease in leases:
            lease.release()
        capped = principal("bob", limit=1)
        lease = limiter.try_acquire(capped)
        with pytest.raises(TooManyRequests):
            limiter.try_acquire(capped)
        lease.release()
        lease.release()  # idempotent: a stream may release from several exits
        assert limiter.in_flight("bob") == 0
        limiter.try_acquire(capped).release()

    asyncio.run(scenario())


def test_retry_after_follows_request_duration():
    limiter = ConcurrencyLimiter(default_max_concurrent=1, max_retry_after_s=30)
    who = principal("alice")
    lease = limiter.try_acquire(who)
    lease._started -= 11.5  # pretend it ran 11.5 s: one slot, so the next frees in about 12 s
    lease.release()
    limiter.try_acquire(who)
    with pytest.raises(TooManyRequests) as excinfo:
        limiter.try_acquire(who)
    assert excinfo.value.retry_after_s == 12


def test_limiter_config_is_validated():
    with pytest.raises(ValueError, match="positive integer"):
        ConcurrencyLimiter(default_max_concurrent=0)
