"""Tool calling on the real server (`loraserve serve` on a tiny random model) through the clients people
put in front of it: the official `openai` SDK, langchain-openai and instructor.

The model is random, so only forced calls (a named tool_choice and "required") are expected to call:
their arguments must parse and fit the tools' schemas whatever the model and adapter, streamed or not,
mixed in one batch with unconstrained requests. The model's chat template renders `tools=` and the
history's tool turns (tests/platform/tool_fixtures.py); /tokenize shows the rendered prompt.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import instructor
import jsonschema
import langchain_openai
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from factories import make_adapter  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from tool_fixtures import MAX_MODEL_LEN, TOOLS, make_tools_model, make_tools_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MODELS = ("tiny", "helper", "other")  # the base model and two adapters
MAX_TOKENS = 64  # a forced call of these tools takes about 30 tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    model_dir = make_tools_model(root / "model")
    adapters = [
        make_adapter(
            model_dir, root / name, seed=seed, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        )
        for name, seed in (("helper", 6), ("other", 7))
    ]
    args = [
        "--model", str(model_dir), "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", "4", "--cpu-kv-cache-space", "0.05", "--max-loras", "2",
        "--lora-modules", f"helper={adapters[0]}", f"other={adapters[1]}",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    process = ServerProcess(root, args)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def check_calls(calls, names=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    """Each call names one of the tools and its arguments parse and fit that tool's schema."""
    parsed = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        parsed.append((call.function.name, arguments))
    return parsed


def stream_calls(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) reassembled from a chat stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = [call.function.name, call.function.arguments or ""]
                else:
                    calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(call) for _, call in sorted(calls.items())], finish


def test_a_named_tool_choice_calls_it_with_valid_arguments_streamed_or_not(client):
    body = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=MAX_TOKENS, seed=3)
    whole = client.chat.completions.create(temperature=0.9, **body)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = check_calls(choice.message.tool_calls, names=("get_weather",))
    content, streamed, finish = stream_calls(
        client.chat.completions.create(temperature=0.9, stream=True, **body)
    )
    assert streamed == [(name, choice.message.tool_calls[0].function.arguments)]
    assert finish == "tool_calls" and content == ""


def test_required_calls_tools_with_valid_arguments(client):
    body = dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.9)
    single = dict(body, parallel_tool_calls=False, max_tokens=MAX_TOKENS, seed=1)
    whole = client.chat.completions.create(model="helper", **single)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(check_calls(choice.message.tool_calls)) == 1
    _, streamed, finish = stream_calls(client.chat.completions.create(model="helper", stream=True, **single))
    assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    # Parallel calls: the random model ends the array or adds a call about evenly; room for ten calls.
    several = client.chat.completions.create(model="other", seed=2, max_tokens=320, **body)
    assert several.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(several.choices[0].message.tool_calls)) >= 1


def test_none_and_auto_answer_with_text(client):
    for choice_name in ("none", "auto"):
        whole = client.chat.completions.create(
            model="helper", messages=ASK, tools=TOOLS, tool_choice=choice_name, max_tokens=8, temperature=0
        )
        choice = whole.choices[0]
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def test_a_tool_result_turn_renders_through_the_template(client, server):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-7", "content": "18 degrees, sunny"},
    ]
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60)
    assert tokenized.status_code == 200, tokenized.text
    tokenizer = make_tools_tokenizer()
    rendered = tokenizer.decode(tokenized.json()["tokens"])
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        in rendered
    )
    assert "<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n") and '"name": "get_time"' in rendered
    answer = client.chat.completions.create(
        model="other", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert answer.usage.prompt_tokens == tokenized.json()["count"]


def test_forced_and_free_requests_share_a_batch(client):
    """Adapters and constraints mixed: each answer keeps to its own request's rules."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    requests = [
        dict(model="tiny", tools=TOOLS, tool_choice=NAMED),
        dict(model="helper", tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        dict(model="other", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        dict(model="helper"),
        dict(model="other", tools=TOOLS, tool_choice="none"),
        dict(
            model="tiny",
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        ),
    ]

    def ask(extra):
        forced = extra.get("tool_choice", "none") != "none" or "response_format" in extra
        max_tokens = MAX_TOKENS if forced else 16
        return client.chat.completions.create(
            messages=ASK, max_tokens=max_tokens, temperature=0.9, seed=5, **extra
        )

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(ask, requests))
    assert [a.model for a in answers] == ["tiny", "helper@1", "other@1", "helper@1", "other@1", "tiny"]
    assert [name for name, _ in check_calls(answers[0].choices[0].message.tool_calls)] == ["get_weather"]
    assert check_calls(answers[1].choices[0].message.tool_calls)
    assert [name for name, _ in check_calls(answers[2].choices[0].message.tool_calls)] == ["get_time"]
    for free in answers[3:5]:
        assert free.choices[0].message.tool_calls is None
    jsonschema.validate(json.loads(answers[5].choices[0].message.content), schema)


# ---- clients people put in front of the server -------------------------------------------------------


def weather_model():
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather to look up."""

        city: Literal["Paris", "Rome", "Oslo"]
        unit: Literal["celsius", "fahrenheit"]
        days: int = Field(ge=1, le=7)

    return Weather


def test_langchain_bind_tools_and_structured_output(server):
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model="helper", max_tokens=MAX_TOKENS, temperature=0.9,
        seed=4, max_retries=0, timeout=600,
    )  # fmt: skip
    forced = llm.bind_tools(TOOLS, tool_choice="get_time").invoke("What time is it in Oslo?")
    [call] = forced.tool_calls
    assert call["name"] == "get_time" and call["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(call["args"], SCHEMAS["get_time"])
    anything = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke("Weather?")
    assert anything.tool_calls and all(c["name"] in SCHEMAS for c in anything.tool_calls)
    Weather = weather_model()
    weather = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Rome?")
    assert isinstance(weather, Weather) and 1 <= weather.days <= 7


def test_instructor_tools_mode(server):
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600),
        mode=instructor.Mode.TOOLS,
    )
    Weather = weather_model()
    weather = client.chat.completions.create(
        model="other",
        response_model=Weather,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        seed=2,
        max_retries=0,
    )
    assert isinstance(weather, Weather) and weather.city in ("Paris", "Rome", "Oslo")
