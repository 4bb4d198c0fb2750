"""Tool-calling test parts: a Hermes-style chat template for the tiny tokenizer, tools, and a replay engine.

`TOOLS_TEMPLATE` renders `tools=` into the system turn, an assistant turn's `tool_calls` as
`<tool_call>{json}</tool_call>` and `role: "tool"` results as `<tool_response>` in a user turn (Qwen2.5's
layout). `ReplayEngine` stands in for the engine: every request "generates" a recorded text, one token
of the tiny tokenizer at a time, so the parsers run end to end through the app on known model outputs.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
from api_env import build_services
from app_fixtures import CORPUS, make_text_model, make_tokenizer
from loraserve.app import create_app
from loraserve.settings import ServerSettings
from transformers import PreTrainedTokenizerFast

from engine import CompletionOutput, RequestOutput

TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m['role'] != 'system' %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] %}{{- m['content'] }}{%- endif %}"
    "{%- for call in m['tool_calls'] or [] %}"
    "{%- set body = {'name': call['function']['name'], 'arguments': call['function']['arguments']} %}"
    "{{- '\\n<tool_call>\\n' + (body | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_MODEL_LEN = 1024  # tool definitions in the prompt take a few hundred of the tiny tokenizer's tokens

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}, "utc": {"type": "boolean"}},
            "required": ["zone", "utc"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@functools.cache
def make_tools_tokenizer() -> PreTrainedTokenizerFast:
    """app_fixtures' tokenizer, trained also on tool definitions and calls (so a prompt with tools takes a
    few hundred tokens, not a thousand), with TOOLS_TEMPLATE."""
    calls = [json.dumps({"name": "get_weather", "arguments": {"city": c, "unit": "celsius"}}) for c in "xyz"]
    corpus = CORPUS + [json.dumps(TOOLS), TOOLS_TEMPLATE, *calls, "<tool_call> </tool_call> <tool_response>"]
    return make_tokenizer(TOOLS_TEMPLATE, corpus=corpus * 4, vocab_size=1024)


def make_tools_model(folder: Path, seed: int = 5) -> Path:
    """A C1-sized random Llama with the tools tokenizer and template and a context of MAX_MODEL_LEN."""
    return make_text_model(folder, seed, tokenizer=make_tools_tokenizer(), max_model_len=MAX_MODEL_LEN)


class ReplayEngine:
    """An EngineClient that answers every request with `self.text` (each of its `n` completions), one token per
    delta; it keeps each
    request's (params, adapter) so tests can check what the server asked for."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.finish_reason = "stop"
        self.requests: list[tuple[Any, str | None]] = []

    async def generate(
        self, prompt, params, request_id, adapter=None, **_: Any
    ) -> AsyncIterator[RequestOutput]:
        self.requests.append((params, adapter))
        ids = self.tokenizer(self.text, add_special_tokens=False).input_ids
        sent = ""
        for i in range(len(ids)):
            decoded = self.tokenizer.decode(ids[: i + 1], skip_special_tokens=params.skip_special_tokens)
            last = i == len(ids) - 1
            piece, sent = decoded[len(sent) :], decoded
            outputs = [
                CompletionOutput(
                    index=index,
                    text=piece,
                    token_ids=[ids[i]],
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason=self.finish_reason if last else None,
                )
                for index in range(params.n)
            ]
            yield RequestOutput(request_id, None, list(prompt), outputs, finished=last)

    async def abort(self, request_id: str) -> None:
        pass

    def forget_adapter(self, adapter_id: str) -> None:
        pass

    def stats(self) -> None:
        return None


@contextlib.asynccontextmanager
async def replay_client(
    tmp_path: Path, tool_call_parser: str | None = None, tokenizer: Any = None
) -> AsyncIterator[tuple[openai.AsyncOpenAI, ReplayEngine, Any]]:
    """The server's app around a ReplayEngine, the official client on it (in process), and the services.

    `tool_call_parser` set: the server runs with --enable-auto-tool-choice --tool-call-parser it."""
    tokenizer = tokenizer or make_tools_tokenizer()
    engine = ReplayEngine(tokenizer)
    services = build_services(tmp_path, engine=engine)
    services.tokenizer, services.max_model_len = tokenizer, MAX_MODEL_LEN
    settings = ServerSettings(
        served_model_name=services.base_model_id,
        enable_auto_tool_choice=tool_call_parser is not None,
        tool_call_parser=tool_call_parser,
    )
    services.tool_call_parser = settings.auto_tool_call_parser
    app = create_app(settings, services=services)
    async with (
        app.lifespan(),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http,
    ):
        client = openai.AsyncOpenAI(
            base_url="http://testserver/v1", api_key="sk-alpha-admin", http_client=http, max_retries=0
        )
        yield client, engine, services
