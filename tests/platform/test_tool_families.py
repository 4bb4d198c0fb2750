"""Forced tool calls on the real engine for each newer family (Qwen3, Gemma 2, Phi-3): the tools' grammar
holds whatever the architecture, streamed or not. Llama is covered by tests/e2e/test_e2e_tool_calling.py.

The schemas are enums only, so a random model's forced output is bounded (about 80 tokens of the tiny
tokenizer); the tiny models' default template ignores `tools`, which keeps the prompts within their
128-token context.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from app_fixtures import make_text_model
from test_inference_completions import run, sse_events

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": PARAMETERS}},
]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3"])
def test_forced_calls_keep_to_the_schema_on_each_family(tmp_path, arch):
    model_dir = make_text_model(tmp_path / "model", arch=arch)

    async def scenario(client, services):
        base = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 100, "temperature": 1.0}
        named = {**base, "tool_choice": {"type": "function", "function": {"name": "get_forecast"}}, "seed": 1}
        required = {**base, "tool_choice": "required", "parallel_tool_calls": False, "seed": 2}
        return (
            await client.post("/v1/chat/completions", json=named),
            await client.post("/v1/chat/completions", json={**required, "stream": True}),
        )

    named, streamed = run(tmp_path / "run", model_dir, scenario)
    assert named.status_code == 200, named.text
    choice = named.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_forecast"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS)

    assert streamed.status_code == 200, streamed.text
    calls: dict[int, list[str]] = {}
    finishes = []
    for event in sse_events(streamed.text)[:-1]:
        for choice in event["choices"]:
            for delta in choice["delta"].get("tool_calls") or []:
                function = delta.get("function") or {}
                if "id" in delta:
                    calls[delta["index"]] = [function["name"], function.get("arguments") or ""]
                else:
                    calls[delta["index"]][1] += function.get("arguments") or ""
            finishes += [choice["finish_reason"]] if choice["finish_reason"] else []
    assert finishes == ["tool_calls"]
    [(name, arguments)] = calls.values()
    assert name in ("get_weather", "get_forecast")
    jsonschema.validate(json.loads(arguments), PARAMETERS)
