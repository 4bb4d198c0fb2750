"""Tool calling through the server's app and the official `openai` client, on recorded model outputs.

A ReplayEngine (tool_fixtures.py) answers every request with a recorded text, one token at a time, so
each `auto` parser runs end to end (prompt rendering, resolution, parsing, whole and streamed bodies),
and the per-adapter parser is checked: an adapter uploaded with `tool_call_parser` gets "auto" with its
own format, with or without the server's --enable-auto-tool-choice.
"""

from __future__ import annotations

import asyncio
import copy
import json

import msgspec
import openai
import pytest
from api_env import upload_files
from loraserve.inference.tools.grammar import required_schema
from loraserve.inference.tools.types import ToolDefinition
from test_inference_completions import sse_events
from tool_fixtures import ASK, TOOLS, make_tools_tokenizer, replay_client

RECORDED = {
    "hermes": 'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", '
    '"utc": false}}\n</tool_call>',
    "llama3_json": 'I will look. {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
    '{"name": "get_time", "parameters": {"zone": "CET", "utc": false}}',
    "mistral": 'I will look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
    '"celsius"}}, {"name": "get_time", "arguments": {"zone": "CET", "utc": false}}]',
    "pythonic": "[get_weather(city='Paris', unit='celsius'), get_time(zone='CET', utc=False)]",
}
CALLS = [
    ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ("get_time", '{"zone": "CET", "utc": false}'),
]


def replay(tmp_path, scenario, **options):
    async def main():
        async with replay_client(tmp_path, **options) as (client, engine, services):
            return await scenario(client, engine, services)

    return asyncio.run(main())


async def stream_of(client: openai.AsyncOpenAI, **body):
    """(role, content, calls as (id, name, arguments), finish reasons) of a streamed chat completion."""
    role, content, calls, finishes = None, "", {}, []
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            role = role or delta.role
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.type == "function" and call.index not in calls
                    calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
                else:
                    assert call.function.name is None
                    calls[call.index][2] += call.function.arguments
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return role, content, [tuple(c) for _, c in sorted(calls.items())], finishes


@pytest.mark.parametrize("parser", sorted(RECORDED))
def test_auto_parses_each_format_whole_and_streamed(tmp_path, parser):
    async def scenario(client, engine, services):
        engine.text = RECORDED[parser]
        body = dict(model="tiny-llama", messages=ASK, tools=TOOLS)
        whole = await client.chat.completions.create(**body)
        streamed = await stream_of(client, **body)
        return whole, streamed, engine.requests[0][0]

    whole, (role, content, calls, finishes), params = replay(tmp_path, scenario, tool_call_parser=parser)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and finishes == ["tool_calls"]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == CALLS
    ids = [c.id for c in choice.message.tool_calls] + [call_id for call_id, _, _ in calls]
    if parser == "mistral":  # Mistral's templates take only 9 letters and digits
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("chatcmpl-tool-") for i in ids)
    assert [(name, arguments) for _, name, arguments in calls] == CALLS
    expected_content = None if parser == "pythonic" else "I will look."
    assert choice.message.content == expected_content and role == "assistant"
    assert (content or None) == expected_content
    assert params.structured_outputs is None  # "auto" never constrains the output


def test_auto_without_a_parser_is_vllms_400(tmp_path):
    async def scenario(client, engine, services):
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS)
        return error.value, engine.requests

    error, requests = replay(tmp_path, scenario)
    assert error.body["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    assert error.body["param"] == "tool_choice" and requests == []


def test_plain_text_and_malformed_calls_stay_content(tmp_path):
    async def scenario(client, engine, services):
        results = []
        for text in ("Paris is sunny today.", '<tool_call>{"name": get_weather}</tool_call>'):
            engine.text = text
            body = dict(model="tiny-llama", messages=ASK, tools=TOOLS)
            results.append(
                (text, await client.chat.completions.create(**body), await stream_of(client, **body))
            )
        return results

    for text, whole, (_, content, calls, finishes) in replay(tmp_path, scenario, tool_call_parser="hermes"):
        assert whole.choices[0].message.content == text == content
        assert whole.choices[0].message.tool_calls is None and calls == []
        assert whole.choices[0].finish_reason == "stop" and finishes == ["stop"]


def test_none_renders_the_tools_but_never_parses(tmp_path):
    async def scenario(client, engine, services):
        engine.text = RECORDED["hermes"]
        whole = await client.chat.completions.create(
            model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="none"
        )
        return whole, engine.requests[0][0]

    whole, params = replay(tmp_path, scenario, tool_call_parser="hermes")
    assert whole.choices[0].message.content == RECORDED["hermes"]
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    assert params.structured_outputs is None


def test_named_and_required_constrain_decoding_with_the_tools_schemas(tmp_path):
    arguments = '{"city": "Rome", "unit": "fahrenheit", "days": 3}'
    required = json.dumps(
        [
            {"name": "get_weather", "parameters": json.loads(arguments)},
            {"name": "get_time", "parameters": {"zone": "UTC", "utc": True}},
        ]
    )

    async def scenario(client, engine, services):
        out = []
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, text in ((named, arguments), ("required", required)):
            engine.text = text
            body = dict(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice=choice)
            out.append((await client.chat.completions.create(**body), await stream_of(client, **body)))
        return out, [params for params, _ in engine.requests]

    (named, required_out), params = replay(tmp_path, scenario)  # no parser needed for either
    tools = msgspec.convert(TOOLS, list[ToolDefinition])
    assert json.loads(params[0].structured_outputs.json) == TOOLS[0]["function"]["parameters"]
    assert json.loads(params[2].structured_outputs.json) == required_schema(tools, True)
    whole, (_, content, calls, finishes) = named
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        ("get_weather", arguments)
    ]
    assert whole.choices[0].message.content is None and content == ""
    assert [(name, args) for _, name, args in calls] == [("get_weather", arguments)]
    assert whole.choices[0].finish_reason == "tool_calls" and finishes == ["tool_calls"]
    whole, (_, _, calls, _) = required_out
    expected = [
        ("get_weather", '{"city": "Rome", "unit": "fahrenheit", "days": 3}'),
        ("get_time", '{"zone": "UTC", "utc": true}'),
    ]
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == expected
    assert [(name, args) for _, name, args in calls] == expected


def test_parallel_tool_calls_false_is_honoured(tmp_path):
    async def scenario(client, engine, services):
        engine.text = RECORDED["hermes"]
        body = dict(model="tiny-llama", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
        auto = await client.chat.completions.create(**body)
        await client.chat.completions.create(**{**body, "tool_choice": "required"})
        return auto, engine.requests[1][0]

    auto, required_params = replay(tmp_path, scenario, tool_call_parser="hermes")
    assert [c.function.name for c in auto.choices[0].message.tool_calls] == ["get_weather"]
    assert json.loads(required_params.structured_outputs.json)["maxItems"] == 1


def test_stream_chunks_have_openais_shape(tmp_path):
    async def scenario(client, engine, services):
        engine.text = RECORDED["hermes"]
        body = {"model": "tiny-llama", "messages": ASK, "tools": TOOLS, "stream": True}
        response = await client._client.post("/v1/chat/completions", json=body, headers=client.auth_headers)
        return sse_events(response.text)

    events = replay(tmp_path, scenario, tool_call_parser="hermes")
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = tool_deltas[0]
    assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
    assert first["function"]["name"] == "get_weather"
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        for d in tool_deltas[1:]
        if "id" not in d
    )
    assert [d["index"] for d in tool_deltas if "id" in d] == [0, 1]
    assert deltas[0]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_special_token_markers_are_kept_in_the_text(tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: detokenizing drops it unless the server asks it not to."""
    tokenizer = copy.deepcopy(make_tools_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})

    async def scenario(client, engine, services):
        engine.text = RECORDED["mistral"]
        whole = await client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS)
        return whole, engine.requests[0][0]

    whole, params = replay(tmp_path, scenario, tool_call_parser="mistral", tokenizer=tokenizer)
    assert params.skip_special_tokens is False
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == CALLS
    assert all(len(c.id) == 9 and c.id.isalnum() for c in whole.choices[0].message.tool_calls)


@pytest.mark.parametrize("server_parser", [None, "hermes"])
def test_an_adapter_uploaded_with_a_parser_uses_its_own(tmp_path, peft_adapters, server_parser):
    async def scenario(client, engine, services):
        http = client._client
        files = upload_files(peft_adapters["qv"])
        upload = await http.post(
            "/v1/adapters",
            data={"name": "caller", "tool_call_parser": "pythonic"},
            files=files,
            headers=client.auth_headers,
        )
        plain = await http.post(
            "/v1/adapters", data={"name": "plain"}, files=files, headers=client.auth_headers
        )
        bad = await http.post(
            "/v1/adapters",
            data={"name": "x", "tool_call_parser": "nope"},
            files=files,
            headers=client.auth_headers,
        )
        as_file = await http.post(
            "/v1/adapters",
            data={"name": "y"},
            files=[*files, ("tool_call_parser", ("parser.txt", b"hermes"))],
            headers=client.auth_headers,
        )
        listed = (await http.get("/v1/adapters/caller", headers=client.auth_headers)).json()
        engine.text = RECORDED["pythonic"]
        adapter = await client.chat.completions.create(model="caller", messages=ASK, tools=TOOLS)
        streamed = await stream_of(client, model="caller@1", messages=ASK, tools=TOOLS)
        others = []
        for model in ("tiny-llama", "plain"):
            try:
                others.append(await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS))
            except openai.BadRequestError as exc:
                others.append(exc)
        return upload, plain, (bad, as_file), listed, adapter, streamed, others

    upload, plain, (bad, as_file), listed, adapter, streamed, others = replay(
        tmp_path, scenario, tool_call_parser=server_parser
    )
    assert upload.status_code == 201 and upload.json()["tool_call_parser"] == "pythonic"
    assert "tool_call_parser" not in plain.json()
    assert (
        bad.status_code == 422 and "'nope' is not one of the parsers hermes" in bad.json()["error"]["message"]
    )
    assert as_file.status_code == 422 and "must be a text field" in as_file.json()["error"]["message"]
    assert listed["latest"]["tool_call_parser"] == "pythonic"
    assert adapter.model == "caller@1"
    assert [(c.function.name, c.function.arguments) for c in adapter.choices[0].message.tool_calls] == CALLS
    assert [(name, args) for _, name, args in streamed[2]] == CALLS
    for other in others:  # the base model and an adapter without a parser of its own: the server's
        if server_parser is None:
            assert isinstance(other, openai.BadRequestError) and "requires --enable-auto-tool-choice" in str(
                other
            )
        else:  # hermes finds no call in pythonic text
            assert other.choices[0].message.content == RECORDED["pythonic"]
            assert other.choices[0].message.tool_calls is None


def test_each_choice_of_n_is_parsed_on_its_own(tmp_path):
    async def scenario(client, engine, services):
        engine.text = RECORDED["hermes"]
        body = dict(model="tiny-llama", messages=ASK, tools=TOOLS, n=2)
        whole = await client.chat.completions.create(**body)
        calls: dict[int, dict[int, list]] = {0: {}, 1: {}}
        async for chunk in await client.chat.completions.create(stream=True, **body):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    entry = calls[choice.index].setdefault(call.index, [call.function.name, ""])
                    entry[1] += call.function.arguments or ""
        return whole, calls

    whole, calls = replay(tmp_path, scenario, tool_call_parser="hermes")
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == CALLS
        assert [tuple(call) for _, call in sorted(calls[choice.index].items())] == CALLS
    ids = [c.id for choice in whole.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_a_schema_xgrammar_cannot_compile_is_a_400_naming_tools(tmp_path):
    broken = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    ]
    named = {"type": "function", "function": {"name": "f"}}

    async def scenario(client, engine, services):
        errors = []
        for choice in (named, "required"):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(
                    model="tiny-llama", messages=ASK, tools=broken, tool_choice=choice
                )
            errors.append(error.value.body)
        return errors, engine.requests

    errors, requests = replay(tmp_path, scenario)
    for body in errors:
        assert body["param"] == "tools" and "properties must be an object" in body["message"]
    assert requests == []
