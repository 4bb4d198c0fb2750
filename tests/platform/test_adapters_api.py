"""POST/GET/DELETE /v1/adapters through the real controllers, store and exception table."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest
from api_env import ADMIN_A, ADMIN_B, USER_A, bearer, upload, upload_files
from litestar.testing import TestClient
from loraserve.adapters import upload_limit_bytes

RECORD_FIELDS = {
    "name",
    "version",
    "rank",
    "alpha",
    "target_modules",
    "base_model",
    "sha256",
    "size_bytes",
    "created_at",
    "format",
    "vocab_modules",
}


@pytest.fixture
def env(api_env):
    return api_env()


@pytest.fixture
def client(env):
    with TestClient(env.app) as client:
        yield client


def upload_archive(client, name, filename, data, key=ADMIN_A):
    return client.post(
        "/v1/adapters", data={"name": name}, files=[("archive", (filename, data))], headers=bearer(key)
    )


def tar_gz(folder, top="my-adapter") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f"{top}/{f.name}")
    return buffer.getvalue()


def zip_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def assert_error(response, status, code, *fragments):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == code
    for fragment in fragments:
        assert fragment in error["message"]
    return error


def test_upload_two_files_returns_the_record(client, peft_adapters):
    response = upload(client, "support", peft_adapters["qv"])
    assert response.status_code == 201, response.text
    body = response.json()
    assert set(body) >= RECORD_FIELDS
    assert (body["name"], body["version"], body["rank"], body["alpha"]) == ("support", 1, 8, 16.0)
    assert sorted(body["target_modules"]) == ["q_proj", "v_proj"]
    assert body["size_bytes"] == (peft_adapters["qv"] / "adapter_model.safetensors").stat().st_size
    assert len(body["sha256"]) == 64 and body["created_at"].endswith("Z")
    assert body["format"] == "lora" and body["vocab_modules"] == {}


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_upload_archive(client, peft_adapters, kind):
    folder = peft_adapters["all"]
    if kind == "tar.gz":
        data = tar_gz(folder)
    else:
        data = zip_of({f"x/{f.name}": f.read_bytes() for f in folder.iterdir()})
    response = upload_archive(client, "packed", f"adapter.{kind}", data)
    assert response.status_code == 201, response.text
    assert (response.json()["rank"], len(response.json()["target_modules"])) == (4, 7)


def test_new_upload_of_a_name_is_a_new_version_and_get_lists_versions(client, peft_adapters):
    assert upload(client, "bot", peft_adapters["qv"]).json()["version"] == 1
    assert upload(client, "bot", peft_adapters["all"]).json()["version"] == 2
    upload(client, "other", peft_adapters["qv"])

    listed = client.get("/v1/adapters", headers=bearer(USER_A)).json()
    assert listed["object"] == "list"
    assert [(a["name"], a["version"]) for a in listed["data"]] == [("bot", 2), ("other", 1)]

    detail = client.get("/v1/adapters/bot", headers=bearer(USER_A)).json()
    assert detail["latest"]["version"] == 2 and detail["latest"]["rank"] == 4
    assert [v["version"] for v in detail["versions"]] == [1, 2]
    one = client.get("/v1/adapters/bot@1", headers=bearer(USER_A)).json()
    assert (one["version"], one["rank"]) == (1, 8)


def test_delete_one_version_then_all_tells_the_engine(client, env, peft_adapters):
    upload(client, "bot", peft_adapters["qv"])
    upload(client, "bot", peft_adapters["all"])
    response = client.delete("/v1/adapters/bot@1", headers=bearer(ADMIN_A))
    assert response.status_code == 200, response.text
    assert response.json()["versions"] == [1]
    assert env.engine.forgotten == ["alpha/bot@1"]
    assert_error(client.get("/v1/adapters/bot@1", headers=bearer(ADMIN_A)), 404, "adapter_not_found")
    assert client.get("/v1/adapters/bot", headers=bearer(ADMIN_A)).json()["latest"]["version"] == 2

    assert client.delete("/v1/adapters/bot", headers=bearer(ADMIN_A)).json()["versions"] == [2]
    assert env.engine.forgotten == ["alpha/bot@1", "alpha/bot@2"]
    assert client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"] == []
    # Version numbers are never reused: a new upload is version 3.
    assert upload(client, "bot", peft_adapters["qv"]).json()["version"] == 3


def test_delete_discards_the_disk_cache_copy(client, env, peft_adapters):
    record = env.services.adapter_store.resolve(
        "alpha", upload(client, "bot", peft_adapters["qv"]).json()["name"]
    )
    with env.services.disk_cache.checkout("alpha", record) as cached:
        assert cached.path.is_dir()
    client.delete("/v1/adapters/bot", headers=bearer(ADMIN_A))
    assert not cached.path.exists()


@pytest.mark.parametrize(
    ("changes", "code", "fragment"),
    [
        ({"r": 64, "lora_alpha": 64}, "rank_too_large", "rank"),
        ({"peft_type": "PREFIX_TUNING"}, "unsupported_peft_type", "PREFIX_TUNING"),
        ({"use_dora": True}, "missing_magnitude", "lora_magnitude_vector is missing"),
    ],
)
def test_invalid_adapter_config_is_422_with_the_validator_message(
    client, peft_adapters, edit_adapter, changes, code, fragment
):
    response = upload(client, "bad", edit_adapter(peft_adapters["qv"], changes))
    error = assert_error(response, 422, response.json()["error"]["code"], fragment)
    assert error["type"] == "invalid_request_error"
    assert client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"] == []  # nothing half-written


def test_form_mistakes_are_422(client, peft_adapters):
    folder = peft_adapters["qv"]
    config = ("files", ("adapter_config.json", (folder / "adapter_config.json").read_bytes()))
    weights = ("files", ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes()))
    h = bearer(ADMIN_A)
    assert_error(
        client.post("/v1/adapters", files=[config, weights], headers=h), 422, "missing_name", "'name'"
    )
    assert_error(
        client.post("/v1/adapters", data={"name": "a"}, files=[config], headers=h), 422, "missing_weights"
    )
    assert_error(client.post("/v1/adapters", files=[("name", (None, b"a"))], headers=h), 422, "missing_files")
    assert_error(
        client.post("/v1/adapters", data={"name": "a"}, headers=h), 422, "bad_upload", "multipart/form-data"
    )
    both = [config, weights, ("archive", ("a.tar.gz", tar_gz(folder)))]
    assert_error(
        client.post("/v1/adapters", data={"name": "a"}, files=both, headers=h), 422, "bad_upload", "not both"
    )
    pickle = ("files", ("adapter_model.bin", b"\x80\x04not really"))
    assert_error(
        client.post("/v1/adapters", data={"name": "a"}, files=[config, pickle], headers=h),
        422,
        "pickle_refused",
    )
    assert_error(upload(client, "../escape", folder), 422, "invalid_name")
    assert_error(upload(client, "a@2", folder), 422, "invalid_name", "@")


def test_pickle_renamed_to_safetensors_is_refused_by_its_header(client, peft_adapters):
    folder = peft_adapters["qv"]
    files = [
        ("files", ("adapter_config.json", (folder / "adapter_config.json").read_bytes())),
        ("files", ("adapter_model.safetensors", b"\x80\x04\x95" + b"\x00" * 64)),
    ]
    response = client.post("/v1/adapters", data={"name": "sneaky"}, files=files, headers=bearer(ADMIN_A))
    assert response.status_code == 422 and "safetensors" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("members", "code"),
    [
        ({"../../etc/evil": b"x", "adapter_config.json": b"{}"}, "unsafe_archive"),
        ({"/abs/adapter_config.json": b"{}"}, "unsafe_archive"),
        ({f"f{i}.md": b"" for i in range(20)}, "too_many_files"),
    ],
)
def test_archive_attacks_are_refused(client, members, code):
    status = 413 if code == "too_many_files" else 422
    assert_error(upload_archive(client, "evil", "evil.zip", zip_of(members)), status, code)


def test_tar_symlink_is_refused(client):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        link = tarfile.TarInfo("adapter_model.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    assert_error(
        upload_archive(client, "evil", "evil.tar.gz", buffer.getvalue()), 422, "unsafe_archive", "link"
    )


def test_not_an_archive_is_422(client):
    assert_error(
        upload_archive(client, "x", "x.tar.gz", b"plain text, no archive"), 422, "unsupported_archive"
    )


def test_oversize_body_is_413_before_the_store_sees_it(client, env):
    limit = upload_limit_bytes(env.store_config)
    response = upload_archive(client, "huge", "huge.tar.gz", b"\x00" * (limit + 1))
    assert_error(response, 413, "request_too_large", str(limit))
    assert client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"] == []


def test_weights_over_the_store_limit_are_413(client, env, peft_adapters):
    folder = peft_adapters["qv"]
    files = [
        ("files", ("adapter_config.json", (folder / "adapter_config.json").read_bytes())),
        ("files", ("adapter_model.safetensors", b"\x00" * (env.store_config.max_adapter_bytes + 1))),
    ]
    response = client.post("/v1/adapters", data={"name": "big"}, files=files, headers=bearer(ADMIN_A))
    assert_error(response, 413, "upload_too_large", "max_adapter_bytes")


def test_auth_user_key_403_unknown_key_401(client, peft_adapters):
    assert_error(upload(client, "bot", peft_adapters["qv"], key=USER_A), 403, "insufficient_permissions")
    upload(client, "bot", peft_adapters["qv"])
    assert_error(client.delete("/v1/adapters/bot", headers=bearer(USER_A)), 403, "insufficient_permissions")
    assert_error(client.get("/v1/adapters", headers=bearer("sk-nobody")), 401, "invalid_api_key")
    assert_error(client.get("/v1/adapters"), 401, "invalid_api_key")


def test_other_tenants_adapter_is_exactly_a_missing_one(client, env, peft_adapters):
    upload(client, "secret", peft_adapters["qv"])  # tenant alpha
    for path in ("/v1/adapters/secret", "/v1/adapters/secret@1"):
        theirs = client.get(path, headers=bearer(ADMIN_B))
        missing = client.get(path.replace("secret", "nothing"), headers=bearer(ADMIN_B))
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json() == {
            "error": {
                **missing.json()["error"],
                "message": missing.json()["error"]["message"].replace("nothing", "secret"),
            }
        }
    assert client.get("/v1/adapters", headers=bearer(ADMIN_B)).json()["data"] == []
    assert client.delete("/v1/adapters/secret", headers=bearer(ADMIN_B)).status_code == 404
    assert env.engine.forgotten == []
    assert client.get("/v1/adapters/secret", headers=bearer(ADMIN_A)).status_code == 200


def test_text_fields_are_capped_and_bodies_must_be_whole_multipart(client, peft_adapters):
    h = bearer(ADMIN_A)
    long_name = [("name", (None, b"n" * 5000)), *upload_files(peft_adapters["qv"])]
    assert_error(
        client.post("/v1/adapters", files=long_name, headers=h), 422, "bad_upload", "longer than 1024 bytes"
    )
    boundary = "b0undary"
    truncated = f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nabc'.encode()
    headers = {**h, "content-type": f"multipart/form-data; boundary={boundary}"}
    assert_error(client.post("/v1/adapters", content=truncated, headers=headers), 422, "bad_upload")
    assert client.get("/v1/adapters", headers=h).json()["data"] == []


def test_a_user_key_is_refused_before_the_body_is_read(client, env):
    too_big = b"\x00" * (upload_limit_bytes(env.store_config) + 1)
    response = upload_archive(client, "huge", "huge.tar.gz", too_big, key=USER_A)
    assert_error(response, 403, "insufficient_permissions")
