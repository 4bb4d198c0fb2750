"""The `--tool-call-parser` formats, by vLLM's names."""

from __future__ import annotations

from loraserve.inference.tools.parsers.base import Parsed, PartialCall, ToolParser
from loraserve.inference.tools.parsers.hermes import HermesParser
from loraserve.inference.tools.parsers.llama3_json import Llama3JsonParser
from loraserve.inference.tools.parsers.mistral import MistralParser
from loraserve.inference.tools.parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get_parser(name: str) -> ToolParser:
    """The parser of that name; KeyError with vLLM's wording for one that does not exist."""
    if name not in PARSERS:
        raise KeyError(unknown_parser_message(name))
    return PARSERS[name]()


def unknown_parser_message(name: str) -> str:
    return f"invalid tool call parser: {name} (chose from {{ {','.join(PARSERS)} }})"


__all__ = ["PARSERS", "Parsed", "PartialCall", "ToolParser", "get_parser", "unknown_parser_message"]
