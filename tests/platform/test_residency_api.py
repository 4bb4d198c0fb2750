"""The operator's residency endpoints (the placement loop's admin API): only on the metrics listener, only
with the placement key; a clear 400, 404 or 409 for what they cannot do; preload, pin, unpin, unload."""

from __future__ import annotations

import asyncio

import pytest
from app_fixtures import keys_for, make_text_model
from factories import make_adapter
from loraserve.settings import ServerSettings
from test_inference_completions import run

KEY = "placement-key-0123456789"
OPERATOR = {"authorization": f"Bearer {KEY}"}
LISTENER = "http://testserver:8001/v1/residency"
MAIN = "http://testserver/v1/residency"
KEYS = keys_for(alpha=("sk-alpha", "admin", None))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("residency-api") / "model")


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    return make_adapter(model_dir, tmp_path_factory.mktemp("residency-api-adapter") / "a", seed=3, r=4)


async def until_resident(client, check, timeout_s: float = 30.0) -> list[dict]:
    for _ in range(int(timeout_s / 0.02)):
        adapters = (await client.get(LISTENER, headers=OPERATOR)).json()["adapters"]
        if check(adapters):
            return adapters
        await asyncio.sleep(0.02)
    raise AssertionError(adapters)


@pytest.mark.slow
def test_preload_pin_unpin_and_unload(tmp_path, model_dir, adapter_dir):
    async def scenario(client, services):
        for name in ("a", "b", "c"):
            services.adapter_store.put("alpha", name, adapter_dir)
        answers = {}
        answers["cpu"] = await client.post(
            f"{LISTENER}/preload", json={"adapter": "alpha/a", "level": "cpu"}, headers=OPERATOR
        )
        cpu = await until_resident(client, lambda a: a and a[0]["level"] == "cpu")
        answers["pin"] = await client.post(
            f"{LISTENER}/preload", json={"adapter": "alpha/a@1", "pin": True}, headers=OPERATOR
        )
        pinned = await until_resident(client, lambda a: a and a[0]["placed"])
        # max_loras 2: one slot stays free for requests
        answers["second pin"] = await client.post(
            f"{LISTENER}/preload", json={"adapter": "alpha/b", "pin": True}, headers=OPERATOR
        )
        answers["gpu"] = await client.post(
            f"{LISTENER}/preload", json={"adapter": "alpha/b"}, headers=OPERATOR
        )
        both = await until_resident(client, lambda a: len([x for x in a if x["level"] == "gpu"]) == 2)
        answers["unpin"] = await client.post(
            f"{LISTENER}/unpin", json={"adapter": "alpha/a"}, headers=OPERATOR
        )
        unpinned = await until_resident(client, lambda a: not any(x["placed"] for x in a))
        answers["unload"] = await client.post(
            f"{LISTENER}/unpin", json={"adapter": "alpha/b", "unload": True}, headers=OPERATOR
        )
        left = await until_resident(client, lambda a: [x["adapter"] for x in a] == ["alpha/a@1"])
        view = (await client.get(LISTENER, headers=OPERATOR)).json()
        return answers, cpu, pinned, both, unpinned, left, view

    answers, cpu, pinned, both, unpinned, left, view = run(
        tmp_path, model_dir, scenario, ServerSettings(placement_key=KEY), api_keys=KEYS
    )
    assert answers["cpu"].status_code == 202
    assert answers["cpu"].json() == {"adapter": "alpha/a@1", "adapter_name": "alpha/a"}
    assert cpu == [
        {
            "adapter": "alpha/a@1",
            "adapter_name": "alpha/a",
            "level": "cpu",
            "pinned": False,
            "placed": False,
            "rank": 4,
        }
    ]
    assert answers["pin"].status_code == 202
    assert pinned[0] | {"level": "gpu", "pinned": True, "placed": True} == pinned[0]
    second = answers["second pin"]
    assert second.status_code == 409 and second.json()["error"]["code"] == "pin_limit"
    assert answers["gpu"].status_code == 202 and {a["adapter"] for a in both} == {"alpha/a@1", "alpha/b@1"}
    assert answers["unpin"].status_code == 200 and answers["unload"].status_code == 200
    assert {a["adapter"]: a["pinned"] for a in unpinned} == {"alpha/a@1": False, "alpha/b@1": False}
    assert left[0]["level"] == "gpu" and view["max_gpu_lora_adapters"] == 2 and view["max_operator_pins"] == 1


@pytest.mark.slow
def test_only_the_operator_on_the_metrics_listener_reaches_them(tmp_path, model_dir, adapter_dir):
    async def scenario(client, services):
        services.adapter_store.put("alpha", "a", adapter_dir)
        body = {"adapter": "alpha/a"}
        tenant_admin = {"authorization": "Bearer sk-alpha"}
        return {
            "main port": await client.post(f"{MAIN}/preload", json=body, headers=OPERATOR),
            "main port, tenant admin": await client.get(MAIN, headers=tenant_admin),
            "no key": await client.post(f"{LISTENER}/preload", json=body),
            "tenant admin key": await client.post(f"{LISTENER}/preload", json=body, headers=tenant_admin),
            "unknown field": await client.post(
                f"{LISTENER}/preload", json={**body, "levle": "gpu"}, headers=OPERATOR
            ),
            "level": await client.post(
                f"{LISTENER}/preload", json={**body, "level": "disk"}, headers=OPERATOR
            ),
            "pin on cpu": await client.post(
                f"{LISTENER}/preload", json={**body, "level": "cpu", "pin": True}, headers=OPERATOR
            ),
            "bare name": await client.post(f"{LISTENER}/preload", json={"adapter": "a"}, headers=OPERATOR),
            "unknown": await client.post(f"{LISTENER}/unpin", json={"adapter": "alpha/zz"}, headers=OPERATOR),
            "bad tenant": await client.post(f"{LISTENER}/unpin", json={"adapter": "../a"}, headers=OPERATOR),
            "tenant API on the listener": await client.get(
                "http://testserver:8001/v1/models", headers=tenant_admin
            ),
        }

    answers = run(tmp_path, model_dir, scenario, ServerSettings(placement_key=KEY), api_keys=KEYS)
    status = {name: answer.status_code for name, answer in answers.items()}
    assert status == {
        "main port": 404,
        "main port, tenant admin": 404,
        "no key": 401,
        "tenant admin key": 401,
        "unknown field": 400,
        "level": 400,
        "pin on cpu": 400,
        "bare name": 400,
        "unknown": 404,
        "bad tenant": 404,
        "tenant API on the listener": 404,
    }
    assert "tenant/name" in answers["bare name"].json()["error"]["message"]
    assert answers["unknown"].json()["error"]["code"] == "adapter_not_found"
    assert "placement key" in answers["no key"].json()["error"]["message"]

    async def without_key(client, services):
        return await client.get(LISTENER, headers=OPERATOR)

    assert run(tmp_path / "off", model_dir, without_key, api_keys=KEYS).status_code == 404  # off by default


def test_the_placement_key_needs_a_metrics_listener():
    with pytest.raises(ValueError, match="at least 16 characters"):
        ServerSettings(placement_key="short")
    with pytest.raises(ValueError, match="needs the metrics listener"):
        ServerSettings(placement_key=KEY, metrics_port=0)
