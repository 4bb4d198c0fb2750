"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter over the tenant's adapter store: admin only,
off unless the operator allows folders, paths confined to them (symlinks and `..` included), the same
validation as uploads, and vLLM's answers and statuses."""

from __future__ import annotations

import json
import os

import openai
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


@pytest.mark.slow
def test_runtime_loading_is_off_without_allowed_folders(tmp_path, model_dir):
    adapter = make_adapter(model_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])

    async def scenario(client, services):
        body = {"lora_name": "a", "lora_path": str(adapter)}
        return await client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)

    response = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "runtime_lora_loading_disabled"


@pytest.mark.slow
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
        "outside": 404,  # as for a missing folder: nothing is told about the disk outside the allowed ones
        "dotdot": 404,
        "symlink": 404,
        "missing": 404,
        "s3": 400,
        "too_big": 400,  # vLLM's status for an adapter that fails validation (uploads answer 422)
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
    assert "is greater than max_lora_rank" in answers["too_big"].json()["error"]["message"]
    for key in ("outside", "dotdot", "symlink"):
        assert "allows loading from" in answers[key].json()["error"]["message"]
    assert {"sql", "sql@1", "sql@2"} <= {m["id"] for m in models["data"]}
    assert answers["unload"].text == "Success: LoRA adapter 'sql' removed successfully."
    assert "cannot be found" in answers["unload_again"].json()["error"]["message"]


@pytest.mark.slow
def test_vllms_statuses_for_bad_loads_and_unloads(tmp_path, model_dir):
    """vLLM's tests/entrypoints/openai lora tests: empty fields 400, a path that is not there 404, files that
    are no adapter 400, adapter_config.json keys the server cannot serve 400 with vLLM's words, and an
    unload of a name that has no adapter 404 even where no adapter could have the name."""
    allowed = tmp_path / "allowed"
    good = make_adapter(model_dir, allowed / "good", r=4, lora_alpha=8, target_modules=["q_proj"])
    (allowed / "not_json").mkdir()
    (allowed / "not_json" / "adapter_config.json").write_text("this is not json")
    cases = {"rank": {"r": 1024}, "bias": {"bias": "all"}, "dora": {"use_dora": True}}
    cases["modules_to_save"] = {"modules_to_save": ["lm_head"]}
    for name, change in cases.items():
        folder = allowed / name
        folder.mkdir()
        for file in good.iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))

    async def scenario(client, services):
        services.allowed_lora_paths = (str(allowed),)
        api = openai.AsyncOpenAI(
            base_url="http://testserver/v1", api_key="sk-admin", http_client=client, max_retries=0
        )

        async def load(name, path):
            return await api.post(
                "load_lora_adapter", cast_to=str, body={"lora_name": name, "lora_path": path}
            )

        raised = {}
        for key, name, path in [
            ("empty", "", ""),
            ("not_found", "notfound", "/not/an/adapter"),
            ("not_json", "invalid-json", str(allowed / "not_json")),
            *[(key, f"test_{key}", str(allowed / key)) for key in cases],
        ]:
            with pytest.raises(openai.APIStatusError) as caught:
                await load(name, path)
            raised[key] = caught.value
        for key, name in [
            ("unload_empty", ""),
            ("unload_unknown", "nonexistent_adapter"),
            ("unload_bad", "a/b"),
        ]:
            with pytest.raises(openai.APIStatusError) as caught:
                await api.post("unload_lora_adapter", cast_to=str, body={"lora_name": name})
            raised[key] = caught.value
        loaded = await load("adapter_0", str(good))
        return raised, loaded

    raised, loaded = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    status = {key: error.status_code for key, error in raised.items()}
    assert status == {
        "empty": 400,
        "not_found": 404,
        "not_json": 400,
        "rank": 400,
        "bias": 400,
        "dora": 400,
        "modules_to_save": 400,
        "unload_empty": 400,
        "unload_unknown": 404,
        "unload_bad": 404,
    }
    words = {
        "rank": "is greater than max_lora_rank",
        "bias": "Adapter bias cannot be used without bias_enabled",
        "dora": "lora_magnitude_vector is missing",  # DoRA is served: its magnitudes must be there
        "modules_to_save": "only supports modules_to_save being None",
    }
    for key, phrase in words.items():
        assert phrase in raised[key].body["message"]
    assert str(tmp_path) not in raised["not_found"].body["message"]
    assert loaded.startswith("Success: LoRA adapter 'adapter_0' added successfully")
