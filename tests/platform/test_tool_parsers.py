"""The `auto` tool-call parsers on recorded model outputs, whole and streamed (token by token, character by
character, in large steps): each stream's deltas add up to exactly the whole response's content and calls.

Cases follow vLLM's parser tests (tests/entrypoints/openai/tool_parsers/) where they apply, with one
deliberate difference: text before the calls is kept as content for every parser (vLLM drops it for
llama3_json), so that a stream, which has already sent that text, and the whole response agree.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from loraserve.inference.tools import ToolOutput
from loraserve.inference.tools.forced import NamedCallParser, RequiredCallsParser
from loraserve.inference.tools.json_partial import JsonSyntaxError, canonical, parse_value
from loraserve.inference.tools.parsers import get_parser
from tool_fixtures import make_tools_tokenizer

WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
CHINESE_ARGS = '{"question": "5MW燃气轮机设计参数 空气流量 压气机压比 转速"}'

CASES = {
    "hermes": [
        ("The weather is nice today.", "The weather is nice today.", []),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>',
            "Let me check.",
            [WEATHER],
        ),
        (  # compact JSON, the name after the arguments, the last call not closed
            '<tool_call>{"name":"get_time","arguments":{"zone":"CET","utc":true}}</tool_call>\n'
            '<tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}',
            None,
            [("get_time", '{"zone": "CET", "utc": true}'), WEATHER],
        ),
        (  # vLLM's recorded QwQ output: reasoning, then a call whose arguments are not ASCII
            "好的，用户现在要研发一个5MW的燃气轮机。\n</think>\n\n<tool_call>\n"
            '{"name": "internet_search", "arguments": {"question": "5MW燃气轮机设计参数 空气流量 '
            '压气机压比 转速"}}\n</tool_call>\n\n ',
            "好的，用户现在要研发一个5MW的燃气轮机。\n</think>",
            [("internet_search", CHINESE_ARGS)],
        ),
        (  # escapes, brackets and the closing tag inside a string; numbers written the canonical way
            '<tool_call>{"name": "echo", "arguments": {"text": "a \\"b\\" \\\\ \\u00e9 \\ud83d\\ude00 '
            '{x} </tool_call>", "n": 1.50, "e": 1E2, "none": null}}</tool_call>',
            None,
            [
                (
                    "echo",
                    '{"text": "a \\"b\\" \\\\ é 😀 {x} </tool_call>", "n": 1.5, "e": 100.0, "none": null}',
                )
            ],
        ),
        (
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Anything after is dropped.',
            None,
            [("get_time", "{}")],
        ),
        ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", "{}")]),  # no arguments: {}
        # malformed calls fall back to text
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            [],
        ),
        ('Hm <tool_call>{"arguments": {}}</tool_call>', 'Hm <tool_call>{"arguments": {}}</tool_call>', []),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
        ("<tool_call>", "<tool_call>", []),
        (  # the first call stands when a later one is malformed
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>',
            None,
            [("get_time", "{}")],
        ),
    ],
    "llama3_json": [
        (
            'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
            "Here is the result:",
            [("getOpenIncidentsTool", "{}")],
        ),
        (
            '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
            None,
            [("searchTool", '{"query": "test query", "limit": 10}')],
        ),
        (
            "This is just some text without any tool calls",
            "This is just some text without any tool calls",
            [],
        ),
        (
            '{"name": "invalidTool", "parameters": {invalid json}',
            '{"name": "invalidTool", "parameters": {invalid json}',
            [],
        ),
        (
            '{"name": "searchTool", "arguments": {"query": "test"}}',
            None,
            [("searchTool", '{"query": "test"}')],
        ),
        (
            '{"name": "searchTool", "parameters": {"query": "test1"}} ; '
            '{"name": "getOpenIncidentsTool", "parameters": {}} ;'
            '{"name": "searchTool", "parameters": {"query": "test2"}}',
            None,
            [
                ("searchTool", '{"query": "test1"}'),
                ("getOpenIncidentsTool", "{}"),
                ("searchTool", '{"query": "test2"}'),
            ],
        ),
        (
            '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": '
            '{"value": "deep"}}}}}}',
            None,
            [("complexTool", '{"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}')],
        ),
        (
            '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": '
            '{"inner": "more {brackets}"}}}',
            None,
            [("searchTool", '{"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}}')],
        ),
        (
            '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
            None,
            [("parserTool", '{"text": "He said \\"Hello {world}\\""}')],
        ),
        (  # a brace that is not a call is text; the search goes on after it
            'In {1, 2} then <|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": null}]}}',
            "In {1, 2} then",
            [("f", '{"a": [1, {"b": null}]}')],
        ),
        ('{"type": "object"}', '{"type": "object"}', []),  # JSON that is not a call
    ],
    "mistral": [
        (
            'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {}}]',
            "Sure.",
            [WEATHER, ("get_time", "{}")],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
            "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}",
            None,
            [WEATHER, ("get_time", "{}")],
        ),
        ("No tools needed.", "No tools needed.", []),
        ("[TOOL_CALLS] Sorry, I cannot.", "[TOOL_CALLS] Sorry, I cannot.", []),
        ('[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', []),
    ],
    "pythonic": [
        ("How can I help you today?", "How can I help you today?", []),
        (
            "[get_weather(city='San Francisco', metric='celsius')]",
            None,
            [("get_weather", '{"city": "San Francisco", "metric": "celsius"}')],
        ),
        (
            "[register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
            "role=None, passed_test=True, aliases=['John', 'Johnny']), get_weather(), "
            "do_something_cool(additional_data={}, steps=[])]",
            None,
            [
                (
                    "register_user",
                    '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, '
                    '"role": null, "passed_test": true, "aliases": ["John", "Johnny"]}',
                ),
                ("get_weather", "{}"),
                ("do_something_cool", '{"additional_data": {}, "steps": []}'),
            ],
        ),
        (
            r"[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]",
            None,
            [("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}')],
        ),
        (
            "<|python_start|>[get_time(zone='CET', utc=False)]<|python_end|>",
            None,
            [("get_time", '{"zone": "CET", "utc": false}')],
        ),
        ("Here: [get_time(zone='CET')]", "Here: [get_time(zone='CET')]", []),  # the list must open the output
        ("[get_time('CET')]", "[get_time('CET')]", []),  # positional arguments are not calls
        ("[get_time(zone=os.system('x'))]", "[get_time(zone=os.system('x'))]", []),  # literals only
        ("[1, 2, 3]", "[1, 2, 3]", []),
    ],
}
PARAMS = [(name, *case) for name, cases in CASES.items() for case in cases]


def whole(output: ToolOutput, text: str):
    content, calls = output.message(text)
    return content, [(c.function.name, c.function.arguments) for c in calls]


def streamed(output: ToolOutput, pieces: list[str]):
    """Replay the pieces as one choice's deltas; the content and calls they add up to."""
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        text, deltas = output.delta(0, piece, i == len(pieces) - 1)
        content += text or ""
        for delta in deltas:
            if delta.id is not None:  # a call's first delta: id, type and the whole name
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
            else:
                assert delta.function.name is None and delta.index in calls
                calls[delta.index][1] += delta.function.arguments
    called = [tuple(call) for _, call in sorted(calls.items())]
    return (content or None) if called else content, called


def token_pieces(text: str) -> list[str]:
    """The text as a detokenizer streams it: one piece per token of the tiny tokenizer."""
    tokenizer = make_tools_tokenizer()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces, sent = [], ""
    for i in range(len(ids)):
        decoded = tokenizer.decode(ids[: i + 1])
        if decoded.endswith("\ufffd") and i < len(ids) - 1:
            continue  # a character split over tokens waits for its last byte, as the engine's does
        pieces.append(decoded[len(sent) :])
        sent = decoded
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("parser, text, content, calls", PARAMS)
def test_whole_and_streamed_outputs_agree(parser, text, content, calls):
    assert whole(ToolOutput(get_parser(parser)), text) == (content, calls)
    steps = {
        "tokens": token_pieces(text),
        "characters": list(text),
        "large steps": [text[i : i + 17] for i in range(0, len(text), 17)],
        "at once": [text],
    }
    for pieces in steps.values():
        assert streamed(ToolOutput(get_parser(parser)), pieces) == (content, calls)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


def test_call_ids_follow_vllm():
    hermes = ToolOutput(get_parser("hermes")).message('<tool_call>{"name": "f"}</tool_call>')[1]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", hermes[0].id)
    mistral = ToolOutput(get_parser("mistral")).message("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}")[1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in mistral)
    assert mistral[0].id != mistral[1].id


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    output = ToolOutput(get_parser("hermes"), single_call=True)
    assert whole(output, text) == (None, [("a", "{}")])
    assert streamed(ToolOutput(get_parser("hermes"), single_call=True), list(text)) == (None, [("a", "{}")])


def test_text_is_held_back_only_while_it_may_open_a_call():
    output = ToolOutput(get_parser("hermes"))
    assert output.delta(0, "Hello <tool", False) == ("Hello", [])
    assert output.delta(0, "box> world ", False) == (" <toolbox> world", [])
    assert output.delta(0, "", True) == (" ", [])


@pytest.mark.parametrize(
    "text, sent",
    [
        ('<tool_call>{"name": "f", "arguments": {"a": 1}', '{"a": '),  # cut off inside the call
        ('<tool_call>{"name": "f"} trailing</tool_call>', "{}"),  # text between the JSON and the tag
        ('<tool_call>{"name": "f", "arguments": {"a": tru}}', '{"a": '),  # bad JSON inside the arguments
    ],
)
def test_a_call_broken_after_its_name_was_streamed_ends_as_text(text, sent):
    """What a stream has sent cannot be taken back: the call stays, its text follows as content."""
    content, calls = streamed(ToolOutput(get_parser("hermes")), list(text))
    assert calls == [("f", sent)] and content == text
    assert whole(ToolOutput(get_parser("hermes")), text) == (text, [])


# ---- forced calls (tool_choice named and "required") ------------------------------------------------


@pytest.mark.parametrize("city", ["a { b", "a } b", "a }} b", 'a " } b', "a \\ } b", "Zürich 😀"])
@pytest.mark.parametrize("step", [1, 2, 3, 8, 9999])
def test_required_calls_stream_into_the_whole_calls(city, step):
    calls = [
        {"name": "get_weather", "parameters": {"city": city, "unit": "celsius"}},
        {"name": "get_time", "parameters": {}},
    ]
    text = json.dumps(calls, ensure_ascii=False)
    expected = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    assert whole(ToolOutput(RequiredCallsParser()), text) == (None, expected)
    assert streamed(ToolOutput(RequiredCallsParser()), pieces) == (None, expected)


def test_required_output_cut_short_is_text():
    text = '[{"name": "get_time", "parameters": {"zone": "CE'
    assert whole(ToolOutput(RequiredCallsParser()), text) == (text, [])


def test_named_call_arguments_are_canonical_json():
    text = '{"city":"Par\tis", "unit": "celsius", "days": 3}'  # a raw tab, as xgrammar lets through
    expected = (None, [("get_weather", '{"city": "Par\\tis", "unit": "celsius", "days": 3}')])
    assert whole(ToolOutput(NamedCallParser("get_weather")), text) == expected
    assert streamed(ToolOutput(NamedCallParser("get_weather")), list(text)) == expected
    assert json.loads(expected[1][0][1]) == {"city": "Par\tis", "unit": "celsius", "days": 3}


# ---- partial JSON ---------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(
        ["object", "array", "string", "number", "literal"] if depth < 3 else ["string", "number"]
    )
    if kind == "object":
        return {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "array":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "string":
        return _random_string(rng)
    if kind == "number":
        return rng.choice([0, -7, 12345678901234567890, 3.25, -0.5, 1e-7, 2.5e300])
    return rng.choice([True, False, None])


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice('ab "\\/\n\t{}[]:,é😀\u2028') for _ in range(rng.randint(0, 6)))


@pytest.mark.parametrize("seed", range(40))
def test_canonical_text_is_json_dumps_and_grows_by_prefixes(seed):
    rng = random.Random(seed)
    value = [_random_value(rng)]  # a bare number could always go on: only containers end for sure
    layout = rng.choice([{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}])
    text = json.dumps(value, **layout)
    expected = json.dumps(value, ensure_ascii=False)
    assert canonical(parse_value(text), text) == expected
    previous = ""
    for end in range(len(text) + 1):
        node = parse_value(text[:end])
        current = canonical(node, text[:end]) if node is not None else ""
        assert current.startswith(previous) and expected.startswith(current), (text[:end], current)
        previous = current


@pytest.mark.parametrize(
    "text, bad_at",
    [
        ('{"a" 1}', 5),
        ('{"a": tru}', 6),
        ("[1,]", 3),
        ('{"a": 01}', 6),
        ('"\\x"', 1),
        ('{"a":1,}', 7),
        ("{'a': 1}", 1),
    ],
)
def test_syntax_errors_are_found_where_they_happen(text, bad_at):
    with pytest.raises(JsonSyntaxError) as error:
        parse_value(text)
    assert error.value.pos == bad_at
    # the text before the bad character still parses as an unfinished value
    assert parse_value(text[:bad_at]) is None or not parse_value(text[:bad_at]).complete
