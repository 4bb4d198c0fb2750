"""vLLM's request `priority` through the real app and engine: honoured under `--scheduling-policy
priority`, a 400 naming the policy under fcfs and fair (never silently ignored), on both endpoints,
streaming or not."""

from __future__ import annotations

import pytest
from app_fixtures import make_text_model
from test_inference_completions import run

PROMPT = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("priority") / "model")


def completion(**fields):
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def chat(**fields):
    messages = [{"role": "user", "content": "Hello"}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


async def post_all(client, bodies):
    return [await client.post(path, json=body) for path, body in bodies]


def test_a_non_zero_priority_is_a_400_under_the_default_fair_policy(tmp_path, model_dir):
    bodies = [
        ("/v1/completions", completion(priority=3)),
        ("/v1/completions", completion(priority=-1, stream=True)),
        ("/v1/chat/completions", chat(priority=1)),
        ("/v1/chat/completions", chat(priority=2, stream=True)),
        ("/v1/completions", completion(priority=0)),  # everyone's default: served
        ("/v1/completions", completion(priority=2**63)),  # wider than the engine takes: the schema's 400
    ]
    responses = run(tmp_path, model_dir, lambda client, services: post_all(client, bodies))
    *refused, served, too_wide = responses
    for response in refused:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
        assert "'priority' scheduling policy" in error["message"] and "'fair'" in error["message"]
    assert served.status_code == 200, served.text
    assert too_wide.status_code == 400 and "priority" in too_wide.json()["error"]["message"]


@pytest.mark.slow
def test_a_non_zero_priority_is_a_400_under_fcfs(tmp_path, model_dir):
    response = run(
        tmp_path,
        model_dir,
        lambda client, services: client.post("/v1/chat/completions", json=chat(priority=-4)),
        scheduling_policy="fcfs",
    )
    assert response.status_code == 400 and "'fcfs'" in response.json()["error"]["message"]


@pytest.mark.slow
def test_priority_is_served_under_the_priority_policy(tmp_path, model_dir):
    bodies = [
        ("/v1/completions", completion(priority=0)),
        ("/v1/completions", completion(priority=7)),
        ("/v1/chat/completions", chat(priority=-2, stream=True)),
    ]
    responses = run(
        tmp_path, model_dir, lambda client, services: post_all(client, bodies), scheduling_policy="priority"
    )
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    # Priority orders requests; it never changes what a greedy request generates.
    assert responses[0].json()["choices"][0]["text"] == responses[1].json()["choices"][0]["text"]
    assert responses[2].text.rstrip().endswith("data: [DONE]")
