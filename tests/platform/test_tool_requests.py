"""Tool requests before any generation: vLLM's 400s for tools / tool_choice, the grammars that force
calls (checked with jsonschema and with xgrammar's matcher on the tiny tokenizer), and the history's tool
turns as the chat template receives them."""

from __future__ import annotations

import copy
import json

import jsonschema
import msgspec
import pytest
from loraserve.errors import BadRequest
from loraserve.inference.prompts import render_chat
from loraserve.inference.schemas import ChatCompletionRequest
from loraserve.inference.tools import plan_tools
from loraserve.inference.tools.grammar import named_schema, required_schema
from loraserve.inference.tools.rendering import add_tool_fields, template_tools
from loraserve.inference.tools.types import ToolDefinition
from tool_fixtures import TOOLS, make_tools_tokenizer

from engine.structured_output import StructuredOutputsParams
from engine.structured_output.grammars import GrammarCompiler

ASK = [{"role": "user", "content": "Hi"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# vLLM's tests/tool_use/test_tool_choice_required.py tools: city required, no other keys
EXAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
]
VIENNA = {"name": "get_current_weather", "parameters": {"city": "Vienna"}}
FORECAST = {"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}}


def request(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": ASK, **fields}, ChatCompletionRequest)


def refused(**fields) -> str:
    with pytest.raises(BadRequest) as error:
        plan_tools(request(**fields))
    return str(error.value)


def test_tool_choice_defaults_like_openai():
    assert plan_tools(request()) is None
    assert plan_tools(request(tools=None, tool_choice="none")) is None
    assert plan_tools(request(tools=TOOLS)).mode == "auto"
    none = plan_tools(request(tools=TOOLS, tool_choice="none"))
    assert none.mode == "none" and none.template_tools()[0]["function"]["name"] == "get_weather"
    named = plan_tools(request(tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False))
    assert (named.mode, named.function_name, named.parallel_tool_calls) == ("named", "get_weather", False)
    assert plan_tools(request(tools=TOOLS, tool_choice="required")).mode == "required"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
        ({"tool_choice": "required", "tools": None}, "When using `tool_choice`, `tools` must be set."),
        ({"tools": []}, "must not be an empty array"),
        ({"tools": TOOLS, "tool_choice": "any"}, "Invalid value for `tool_choice`: any! Only named tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "Invalid value for `function`: `None`"),
        ({"tools": TOOLS, "tool_choice": {"function": {}}}, "Expected field `name` in `function`"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": ""}}}, "Invalid `name` in `function`"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "You can only either use constraints for structured outputs or tools, not both.",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json": {"type": "object"}}},
            "structured outputs or tools, not both",
        ),
    ],
)
def test_bad_tool_requests_get_vllms_messages(fields, message):
    assert message in refused(**fields)


def test_auto_and_none_allow_structured_outputs():
    plan_tools(request(tools=TOOLS, tool_choice="auto", structured_outputs={"json": {"type": "object"}}))
    plan_tools(request(tools=TOOLS, tool_choice=NAMED, response_format={"type": "text"}))


def test_malformed_tools_are_refused_by_the_schema():
    for tools in (
        [{"type": "custom", "function": {"name": "f"}}],
        [{"type": "function"}],
        [{"function": {}}],
    ):
        with pytest.raises(msgspec.ValidationError):
            request(tools=tools)


def test_parameters_must_describe_an_object():
    tool = msgspec.convert(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}, ToolDefinition
    )
    with pytest.raises(BadRequest, match="must be a JSON schema of an object"):
        named_schema(tool)


# ---- the forcing grammars ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler():
    tokenizer = make_tools_tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer))


def accepts(compiler, schema: dict, value) -> bool:
    """Whether xgrammar lets the model write exactly json.dumps(value), then stop; jsonschema must agree."""
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema)))
    grammar = matcher.accept_string(json.dumps(value)) and matcher.accept_token(0)  # 0: eos
    try:
        jsonschema.validate(value, schema)
        valid = True
    except jsonschema.ValidationError:
        valid = False
    assert grammar == valid, (value, grammar, valid)
    return grammar


def tools_of(tools: list[dict]) -> list[ToolDefinition]:
    return msgspec.convert(tools, list[ToolDefinition])


@pytest.mark.parametrize(
    "output, allowed",
    [
        ([VIENNA], True),
        ([VIENNA, {**VIENNA, "parameters": {"city": "Berlin"}}], True),
        ([FORECAST, VIENNA, FORECAST, VIENNA], True),
        (None, False),
        ([], False),  # at least one call
        ({}, False),
        ([{}], False),
        ([{"name": "get_current_weather"}], False),  # parameters are required
        ([{"name": "get_current_weather", "parameters": {}}], False),  # so is city
        ([{"name": "get_current_weather", "parameters": None}], False),
        (VIENNA, False),  # not a list
        ([{"name": "get_current_weather", "parameters": {"city": "Vienna", "extra": "value"}}], False),
        ([{"name": "get_forecast", "parameters": {"city": "Vienna"}}], False),
        ([{"name": "get_weather", "parameters": {"city": "Vienna", "days": 7}}], False),  # no such tool
        ([VIENNA, {}], False),
    ],
)
def test_required_grammar_allows_exactly_calls_of_the_tools(compiler, output, allowed):
    assert accepts(compiler, required_schema(tools_of(EXAMPLE_TOOLS), True), output) is allowed


def test_required_puts_the_name_first(compiler):
    schema = required_schema(tools_of(EXAMPLE_TOOLS), True)
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema)))
    assert not matcher.accept_string('[{"parameters": {"city": "Vienna"}, "name": "get_current_weather"}]')


def test_parallel_tool_calls_false_allows_one_call(compiler):
    schema = required_schema(tools_of(EXAMPLE_TOOLS), parallel_tool_calls=False)
    assert accepts(compiler, schema, [VIENNA])
    assert not accepts(compiler, schema, [VIENNA, FORECAST])


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_function_without_parameters_takes_an_empty_object(compiler, parameters):
    tools = copy.deepcopy(EXAMPLE_TOOLS[:1])
    tools[0]["function"]["parameters"] = parameters
    schema = required_schema(tools_of(tools), True)
    assert accepts(compiler, schema, [{"name": "get_current_weather", "parameters": {}}])
    assert not accepts(compiler, schema, [{"name": "get_current_weather", "parameters": {"extra": 1}}])
    assert not accepts(compiler, schema, [{"name": "get_current_weather"}])


def test_definitions_move_to_the_root_of_the_required_schema(compiler):
    """vLLM's weather tool with a $ref to $defs (test_completion_with_function_calling.py)."""
    options = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    }
    tool = {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "options": {"$ref": "#/$defs/WeatherOptions"}},
                "required": ["city", "options"],
                "$defs": {"WeatherOptions": options},
            },
        },
    }
    tools = tools_of([tool, EXAMPLE_TOOLS[1]])
    schema = required_schema(tools, True)
    call = {"name": "get_current_weather", "parameters": {"city": "Wien", "options": {"unit": "celsius"}}}
    assert accepts(compiler, schema, [call, FORECAST])
    bad = {**call, "parameters": {"city": "Wien", "options": {"unit": "kelvin"}}}
    assert not accepts(compiler, schema, [bad])
    assert accepts(compiler, named_schema(tools[0]), call["parameters"])
    clash = copy.deepcopy(tool)
    clash["function"]["name"] = "other"
    clash["function"]["parameters"]["$defs"]["WeatherOptions"] = {"type": "string"}
    with pytest.raises(BadRequest, match="define \\$defs/WeatherOptions differently"):
        required_schema(tools_of([tool, clash]), True)


# ---- the history's tool turns for the chat template --------------------------------------------------


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        ],
    },
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "12:00"},
]


def test_tool_turns_reach_the_template_as_transformers_expects():
    messages = request(messages=HISTORY).messages
    rendered = add_tool_fields([{"role": m.role, "content": m.content} for m in messages], messages)
    assert rendered[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert rendered[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "chatcmpl-tool-1"}
    assert rendered[4]["name"] == "get_time"


def test_history_and_tools_render_through_the_chat_template():
    body = request(messages=HISTORY, tools=TOOLS)
    text = render_chat(body.messages, make_tools_tokenizer(), tools=template_tools(body.tools))
    tools_json = "\n".join(json.dumps(t) for t in TOOLS)
    assert text == (
        f"<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n{tools_json}\n</tools>\n"
        'Call one with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>"
        "\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_arguments_that_are_not_json_are_a_400():
    history = copy.deepcopy(HISTORY)
    history[2]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    body = request(messages=history)
    with pytest.raises(
        BadRequest, match=r"messages\[2\].tool_calls\[0\].function.arguments is not valid JSON"
    ):
        render_chat(body.messages, make_tools_tokenizer())
