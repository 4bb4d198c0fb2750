"""Tool fields of the chat history and the request's `tools`, as chat templates expect them (as vLLM passes them).

An assistant message's `tool_calls` reach the template with each call's `arguments` parsed into a dict
(templates iterate or `tojson` them; the transformers convention vLLM follows), its content None when
the client sent none; a `role: "tool"` message keeps its `tool_call_id`; a message's `name` is passed on.
The tools go to `apply_chat_template(tools=...)` as OpenAI's `{"type": "function", "function": {...}}`.
"""

from __future__ import annotations

import json
from typing import Any

from loraserve.errors import BadRequest
from loraserve.inference.tools.types import MessageToolCall, ToolDefinition


def add_tool_fields(conversation: list[dict[str, Any]], messages: list[Any]) -> list[dict[str, Any]]:
    """Give each rendered message (role and content text) its message's tool fields and name."""
    for index, (rendered, message) in enumerate(zip(conversation, messages, strict=True)):
        if message.tool_calls is not None:
            rendered["tool_calls"] = [_call(call, index, i) for i, call in enumerate(message.tool_calls)]
            if message.content is None:
                rendered["content"] = None
        if message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            rendered["name"] = message.name
    return conversation


def template_tools(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    rendered = []
    for tool in tools:
        function = tool.function
        fields = {"name": function.name, "description": function.description}
        fields["parameters"] = function.parameters
        rendered.append({"type": "function", "function": {k: v for k, v in fields.items() if v is not None}})
    return rendered


def _call(call: MessageToolCall, message: int, index: int) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise BadRequest(
                f"messages[{message}].tool_calls[{index}].function.arguments is not valid JSON",
                param=f"messages[{message}].tool_calls",
            ) from None
    rendered: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments or {}},
    }
    if call.id is not None:
        rendered["id"] = call.id
    return rendered
