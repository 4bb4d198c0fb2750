"""Tool calling for chat completions: request checks, prompt rendering, forcing grammars and parsers.

request.py    tools / tool_choice / parallel_tool_calls -> ToolPlan (vLLM's 400s)
rendering.py  history tool_calls and tool messages, and `tools=`, for the chat template
grammar.py    the JSON schemas that force a named call or "required" calls (xgrammar)
forced.py     reading those forced calls back from the output
parsers/      "auto": one parser per output format (hermes, llama3_json, mistral, pythonic)
output.py     text -> message.tool_calls, or stream deltas
"""

from loraserve.inference.tools.output import ToolOutput, finish_reason
from loraserve.inference.tools.parsers import PARSERS, unknown_parser_message
from loraserve.inference.tools.rendering import add_tool_fields
from loraserve.inference.tools.request import ToolPlan, plan_tools

__all__ = [
    "PARSERS",
    "ToolOutput",
    "ToolPlan",
    "add_tool_fields",
    "finish_reason",
    "plan_tools",
    "unknown_parser_message",
]
