"""Compile `StructuredOutputsParams` into xgrammar grammars for one tokenizer, with the compiler's cache."""

from __future__ import annotations

import json
import re
from typing import Any

from engine.structured_output.params import StructuredOutputsParams


class GrammarCompiler:
    """One per tokenizer and vocabulary size; thread-safe (xgrammar compiles under its own lock and caches
    compiled grammars by their text, so a spec validated once compiles at no cost the second time)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None = None) -> None:
        import xgrammar  # imported here: only servers that see structured requests pay for it

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; ValueError naming the problem for an invalid schema, regex or grammar."""
        kind = params.kind
        try:
            if kind == "json":
                _check_schema(params.json)
                return self._compiler.compile_json_schema(params.json, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                _check_regex(params.regex)
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_regex("|".join(re.escape(c) for c in params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar reports a bad spec as RuntimeError (or its own errors)
            raise ValueError(f"invalid {kind} for structured output: {_first_line(exc)}") from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)


def _check_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema must be an object (or true/false)")


def _check_regex(pattern: str) -> None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError) as exc:
        raise ValueError(f"invalid regex for structured output: {exc}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
