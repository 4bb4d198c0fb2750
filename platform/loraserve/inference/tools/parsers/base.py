"""What every tool-call parser returns, and the pieces the JSON-based ones share.

A parser reads a response's whole text so far and returns `Parsed`: the content (text meant for the
user) and the calls found, each with its name and arguments as canonical JSON text (json_partial.py).
`final=False` means more text may follow: content then stops short of anything that may turn out to be
a call, a trailing partial marker or trailing whitespace, and a call appears once its name is complete,
with the arguments fixed so far. Everything returned for a prefix of the text is a prefix of what the
whole text gives (the stream sends the differences), as long as the text keeps parsing as calls.

Shared rules, the same for every parser:
- Content is the text before the first call; text after the calls is dropped (as vLLM does).
- Calls are read in order; the first malformed one ends them. If it is the first call, there are no calls
  and the whole text is content (a malformed call falls back to text); otherwise the calls before it stand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.inference.tools.json_partial import JsonSyntaxError, Node, canonical, loads_string

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3.x writes "parameters", most others "arguments"


class Malformed(Exception):
    """The text at a call's place is not a call of this format."""


@dataclass(frozen=True)
class PartialCall:
    name: str
    arguments: str  # canonical JSON text of the arguments object, complete when `complete`
    complete: bool


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """One output format. Subclasses set `name` and implement `parse`; they hold no per-response state."""

    name = ""
    markers: tuple[str, ...] = ()  # text that opens calls; special tokens among them must be detokenized
    mistral_ids = False  # call ids of 9 letters and digits (Mistral's templates refuse any other)

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def settled_text(text: str, markers: tuple[str, ...], final: bool) -> str:
    """Content that later text cannot turn into a call: all of it when final, else without a trailing
    partial marker and trailing whitespace (which stays only if more text follows it)."""
    if final:
        return text
    for size in range(min(len(text), max((len(m) for m in markers), default=0)), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            text = text[:-size]
            break
    return text.rstrip()


def leading_content(text: str) -> str:
    """The content before a call: its trailing whitespace is the call's, not the user's."""
    return text.rstrip()


def malformed(text: str, final: bool, content: str, calls: list[PartialCall]) -> Parsed:
    """A malformed call: the calls before it stand (after `content`), else the whole text is content."""
    if calls:
        return Parsed(content=content, calls=calls)
    return Parsed(content=settled_text(text, (), final))


def call_from_object(node: Node, text: str) -> PartialCall | None:
    """A call from a JSON object `{"name": ..., "arguments": {...}}`; None until its name is complete and
    its arguments object has a first key or has ended (or the call ended without arguments), so that
    a call is rarely sent before it turns out malformed.

    Malformed for a name that is not a string, arguments that are not an object, or (once the object is
    complete) no name. Missing arguments are `{}`."""
    if node.kind != "object":
        raise Malformed("a call must be a JSON object")
    name_node = node.get("name")
    if name_node is not None and name_node.kind != "string":
        raise Malformed("a call's name must be a string")
    arguments = next((node.get(k) for k in ARGUMENT_KEYS if node.get(k) is not None), None)
    if arguments is not None and arguments.kind != "object":
        raise Malformed("a call's arguments must be a JSON object")
    started = arguments is not None and (
        bool(arguments.items) or arguments.open_key is not None or arguments.complete
    )
    if name_node is None or not name_node.complete or not (started or node.complete):
        if node.complete:
            raise Malformed("a call has no name")
        return None  # sent once the name is whole and the arguments have a first key
    name = loads_string(name_node, text)
    if not name:
        raise Malformed("a call's name is empty")
    try:
        args_text = canonical(arguments, text) if arguments is not None else ""
    except JsonSyntaxError as exc:
        raise Malformed(str(exc)) from None
    if node.complete and arguments is None:
        args_text = "{}"
    return PartialCall(name=name, arguments=args_text, complete=node.complete)
