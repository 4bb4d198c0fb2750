"""Structured outputs through the real server and the official `openai` client: response_format
(json_schema, json_object), vLLM's structured_outputs and guided_* fields, streaming with n > 1 and mixed
adapters; invalid or conflicting specs are 400s that name the problem."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from factories import make_adapter  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}, "size": {"type": "boolean"}},
    "required": ["color", "size"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe it."}]


def test_structured_outputs_through_the_openai_client(start_server, tmp_path):
    model_dir = make_text_model(tmp_path / "model")
    adapter = make_adapter(
        model_dir, tmp_path / "helper", seed=6, r=8, lora_alpha=16, target_modules=["q_proj"]
    )
    server = start_server(tiny_server_args(model_dir, "--lora-modules", f"helper={adapter}"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    chat = client.chat.completions.create(
        model="helper",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0.7,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
    )
    value = json.loads(chat.choices[0].message.content)
    assert value["color"] in {"red", "blue"} and isinstance(value["size"], bool)

    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")

    pick = client.completions.create(
        model="tiny",
        prompt="Answer:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert pick.choices[0].text in {"yes", "no"} and pick.choices[0].finish_reason == "stop"

    streamed = client.chat.completions.create(
        model="helper",
        messages=MESSAGES,
        max_tokens=20,
        temperature=1.0,
        seed=5,
        n=2,
        stream=True,
        extra_body={"structured_outputs": {"regex": r"[0-9]{2}-[xy]{3}"}},
    )
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(re.fullmatch(r"[0-9]{2}-[xy]{3}", t) for t in texts), texts

    bad = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"extra_body": {"guided_regex": "(unclosed"}},
        {"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}},
        {"extra_body": {"structured_outputs": {"regex": "a", "structural_tag": "{}"}}},
        {"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}},
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
    ]
    for fields in bad:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **fields)
        assert error.value.status_code == 400, fields
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"
