"""The demo model's chat template: SmolLM2's own text without tools, tools in the layout hermes reads."""

from __future__ import annotations

import json

import pytest
from app_fixtures import make_tokenizer
from loraserve.demo_model import CHAT_TEMPLATE, write_chat_template
from loraserve.inference.tools import ToolOutput
from loraserve.inference.tools.parsers import get_parser

# SmolLM2-135M-Instruct's template as its GGUF ships it (the reference for conversations without tools).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(None)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Name three colours."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_it_writes_what_smollm2_writes(tokenizer, messages, add_generation_prompt):
    def render(template):
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    assert render(CHAT_TEMPLATE.read_text()) == render(SMOLLM2_TEMPLATE)


def test_tools_calls_and_results_render_in_the_layout_hermes_reads(tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "18 C"},
    ]
    text = tokenizer.apply_chat_template(
        messages,
        tools=[TOOL],
        chat_template=CHAT_TEMPLATE.read_text(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n" in text
    # The assistant turn as written is what the adapter learns to write, and hermes reads it back.
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = ToolOutput(get_parser("hermes")).message(turn)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


def test_the_demo_folder_gets_the_template_once(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "eos_token": "x"}))
    write_chat_template(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE.read_text()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"eos_token": "x"}
    before = (tmp_path / "chat_template.jinja").stat().st_mtime_ns
    write_chat_template(tmp_path)
    assert (tmp_path / "chat_template.jinja").stat().st_mtime_ns == before
