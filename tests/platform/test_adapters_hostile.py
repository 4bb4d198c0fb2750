"""Malformed and hostile uploads over HTTP (tests/hostile_adapters.py): every one a 422 with OpenAI's error
body, the config key named in the message and in `param`, never a 5xx, and nothing stored."""

from __future__ import annotations

import json

import pytest
from api_env import ADMIN_A, bearer
from hostile_adapters import (
    CONFIG,
    CONFIG_FILE_IDS,
    CONFIG_FILES,
    PEFT_MISMATCH_IDS,
    PEFT_MISMATCHES,
    WEIGHT_FILE_IDS,
    WEIGHT_FILES,
    WEIGHTS,
    bad_config_value_params,
    num_bad_inputs,
    peft_mismatch_files,
)
from litestar.testing import TestClient


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from api_env import FakeEngine, build_app, build_services

    services = build_services(tmp_path_factory.mktemp("hostile"), engine=FakeEngine())
    with TestClient(build_app(services)) as client:
        yield client


def post(client, config: bytes, weights: bytes):
    files = [("files", (CONFIG, config)), ("files", (WEIGHTS, weights))]
    return client.post("/v1/adapters", data={"name": "bad"}, files=files, headers=bearer(ADMIN_A))


def assert_refused(response, code: str) -> dict:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert len(error["message"]) < 600
    return error


def config_with(folder, key: str, raw: str) -> bytes:
    config = json.loads((folder / CONFIG).read_text())
    config.pop(key, None)
    return (json.dumps(config)[:-1] + f', "{key}": {raw}}}').encode()


@pytest.mark.parametrize(("key", "raw", "code"), bad_config_value_params())
def test_bad_config_values_are_422_naming_the_field(client, peft_adapters, key, raw, code):
    folder = peft_adapters["qv"]
    error = assert_refused(post(client, config_with(folder, key, raw), (folder / WEIGHTS).read_bytes()), code)
    assert key in error["message"] and error["param"] == key


@pytest.mark.parametrize(("case_id", "data", "fragment"), CONFIG_FILES, ids=CONFIG_FILE_IDS)
def test_malformed_config_files_are_422(client, peft_adapters, case_id, data, fragment):
    error = assert_refused(post(client, data, (peft_adapters["qv"] / WEIGHTS).read_bytes()), "bad_config")
    assert fragment in error["message"] and CONFIG in error["message"]


@pytest.mark.parametrize(("case_id", "data", "code", "fragment"), WEIGHT_FILES, ids=WEIGHT_FILE_IDS)
def test_malformed_safetensors_files_are_422(client, peft_adapters, case_id, data, code, fragment):
    error = assert_refused(post(client, (peft_adapters["qv"] / CONFIG).read_bytes(), data), code)
    assert fragment in error["message"]


@pytest.mark.parametrize(
    ("case_id", "changes", "edit", "code", "field"), PEFT_MISMATCHES, ids=PEFT_MISMATCH_IDS
)
def test_adapters_peft_would_refuse_or_serve_differently_are_422(
    client, peft_adapters, case_id, changes, edit, code, field
):
    error = assert_refused(post(client, *peft_mismatch_files(peft_adapters["qv"], changes, edit)), code)
    assert error["param"] == field
    if code == "bad_weight_values":
        assert "lora_" in error["message"], "the message names the tensor"


def test_nothing_was_stored(client):
    """Runs after the tables (same module client): not one of the bad uploads left an adapter."""
    assert client.get("/v1/adapters", headers=bearer(ADMIN_A)).json()["data"] == []
    assert num_bad_inputs() >= 70
