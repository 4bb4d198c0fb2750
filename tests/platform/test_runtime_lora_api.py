"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter over the tenant's adapter store: admin only,
off unless the operator allows folders, paths confined to them (symlinks and `..` included), the same
validation as uploads, and vLLM's answers."""

from __future__ import annotations

import os

import pytest
from app_fixtures import keys_for, make_text_model
from factories import make_adapter
from test_inference_completions import run

ADMIN = {"authorization": "Bearer sk-admin"}
USER = {"authorization": "Bearer sk-user"}
KEYS = keys_for(acme=("sk-admin", "admin", None), other=("sk-user", "user", None))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("runtime") / "model")


def test_runtime_loading_is_off_without_allowed_folders(tmp_path, model_dir):
    adapter = make_adapter(model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])

    async def scenario(client, services):
        body = {"lora_name": "a", "lora_path": str(adapter)}
        return await client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)

    response = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "runtime_lora_loading_disabled"


def test_load_use_replace_and_unload(tmp_path, model_dir):
    allowed = tmp_path / "allowed"
    first = make_adapter(model_dir, allowed / "v1", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    second = make_adapter(model_dir, allowed / "v2", seed=2, r=4, lora_alpha=8, target_modules=["v_proj"])
    too_big = make_adapter(model_dir, allowed / "big", r=32, lora_alpha=8, target_modules=["q_proj"])
    outside = make_adapter(model_dir, tmp_path / "outside", r=4, lora_alpha=8, target_modules=["q_proj"])
    os.symlink(outside, allowed / "escape")

    async def scenario(client, services):
        services.allowed_lora_paths = (str(allowed),)

        async def load(name, path, **extra):
            body = {"lora_name": name, "lora_path": str(path), **extra}
            return await client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)

        answers = {
            "load": await load("sql", first),
            "again": await load("sql", second),
            "inplace": await load("sql", second, load_inplace=True),
            "outside": await load("x", outside),
            "dotdot": await load("x", allowed / ".." / "outside"),
            "symlink": await load("x", allowed / "escape"),
            "missing": await load("x", allowed / "nope"),
            "s3": await load("x", "s3://bucket/adapters/x"),
            "too_big": await load("big", too_big),
            "base": await load("tiny", first),
            "user": await client.post(
                "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(first)}, headers=USER
            ),
        }
        models = (await client.get("/v1/models", headers=ADMIN)).json()
        generate = {"model": "sql", "prompt": "Hello", "max_tokens": 2}
        answers["use"] = await client.post("/v1/completions", json=generate, headers=ADMIN)
        answers["unload"] = await client.post(
            "/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN
        )
        answers["unload_again"] = await client.post(
            "/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN
        )
        answers["gone"] = await client.post("/v1/completions", json=generate, headers=ADMIN)
        return answers, models

    answers, models = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    status = {k: v.status_code for k, v in answers.items()}
    assert status == {
        "load": 200,
        "again": 400,
        "inplace": 200,
        "outside": 400,
        "dotdot": 400,
        "symlink": 400,
        "missing": 400,
        "s3": 400,
        "too_big": 422,
        "base": 409,
        "user": 403,
        "use": 200,
        "unload": 200,
        "unload_again": 404,
        "gone": 404,
    }, {k: v.text for k, v in answers.items() if v.status_code != status.get(k)}
    assert answers["load"].text.startswith("Success: LoRA adapter 'sql' added successfully")
    assert "already been loaded" in answers["again"].json()["error"]["message"]
    assert "version 2" in answers["inplace"].text
    assert "max_lora_rank" in answers["too_big"].json()["error"]["message"]
    for key in ("outside", "dotdot", "symlink"):
        assert "allows loading from" in answers[key].json()["error"]["message"]
    assert {"sql", "sql@1", "sql@2"} <= {m["id"] for m in models["data"]}
    assert answers["unload"].text == "Success: LoRA adapter 'sql' removed successfully."
    assert "cannot be found" in answers["unload_again"].json()["error"]["message"]
