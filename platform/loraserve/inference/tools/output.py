"""Generated text -> the assistant message's content and tool_calls, whole or as stream deltas.

One ToolOutput per request, one stream state per choice. A stream re-reads its choice's whole text at
each delta with the parser and sends what is new since the last chunk: content, a call's first delta
(index, id, type, name and the arguments fixed so far) and then argument fragments. Parsers only ever
extend what they returned for a shorter text (parsers/base.py), so the fragments add up to the whole
response's arguments. A call that turns malformed after its name was streamed cannot be taken back:
its text then follows as content, and the calls already sent stand.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from loraserve.inference.tools.parsers import Parsed, ToolParser
from loraserve.inference.tools.types import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

TOOL_CALLS = "tool_calls"
_ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id(mistral: bool = False) -> str:
    """vLLM's ids: `chatcmpl-tool-<32 hex>`, or 9 letters and digits for Mistral's templates."""
    if mistral:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class _Stream:
    text: str = ""
    content: str = ""  # sent so far
    calls: list[_SentCall] = field(default_factory=list)


class ToolOutput:
    def __init__(self, parser: ToolParser, single_call: bool = False) -> None:
        self.parser = parser
        self.single_call = single_call  # parallel_tool_calls false: only the first call counts
        self._streams: dict[int, _Stream] = {}

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = self.parser.parse(text, final)
        if self.single_call and len(parsed.calls) > 1:
            return Parsed(content=parsed.content, calls=parsed.calls[:1])
        return parsed

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole response's (content, tool_calls); content None when calls came without text."""
        parsed = self.parse(text, final=True)
        calls = [
            ToolCall(
                id=new_call_id(self.parser.mistral_ids),
                function=FunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in parsed.calls
        ]
        return (parsed.content or None) if calls else parsed.content, calls

    def delta(self, index: int, new_text: str, final: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """What choice `index` sends for its next piece of text: (content, tool call deltas)."""
        stream = self._streams.setdefault(index, _Stream())
        stream.text += new_text
        parsed = self.parse(stream.text, final)
        content = None
        if parsed.content.startswith(stream.content) and len(parsed.content) > len(stream.content):
            content = parsed.content[len(stream.content) :]
            stream.content = parsed.content
        deltas = []
        for i, call in enumerate(parsed.calls):
            if i == len(stream.calls):
                sent = _SentCall(new_call_id(self.parser.mistral_ids), call.name, call.arguments)
                stream.calls.append(sent)
                function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
                deltas.append(DeltaToolCall(index=i, id=sent.id, type="function", function=function))
                continue
            sent = stream.calls[i]
            grown = call.name == sent.name and call.arguments.startswith(sent.arguments)
            if grown and len(call.arguments) > len(sent.arguments):
                fragment = call.arguments[len(sent.arguments) :]
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=fragment)))
                sent.arguments = call.arguments
        return content, deltas

    def needs_special_tokens(self, tokenizer: Any) -> bool:
        """Whether a marker of the format is a special token, which detokenizing would otherwise drop
        (Mistral's [TOOL_CALLS], Llama's <|python_tag|>)."""
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special = {token.content for token in added.values() if getattr(token, "special", False)}
        return any(marker in special for marker in self.parser.markers)

    def streamed_calls(self, index: int) -> bool:
        stream = self._streams.get(index)
        return stream is not None and bool(stream.calls)


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when a response that ended normally made calls; other reasons stay."""
    return TOOL_CALLS if has_calls and reason == "stop" else reason
