"""Compile `StructuredOutputsParams` into xgrammar grammars for one tokenizer.

Slow for large specs: the engine calls it on its compile threads (compile_pool.py), never on its loop.
"""

from __future__ import annotations

import re
from typing import Any

from engine.structured_output.budget import StructuredOutputError, check_spec
from engine.structured_output.params import StructuredOutputsParams


class GrammarCompiler:
    """One per tokenizer and vocabulary size; thread-safe (xgrammar compiles specs concurrently)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        *,
        cache_enabled: bool = True,
    ) -> None:
        import xgrammar  # imported here: only servers that see structured requests pay for it

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=cache_enabled)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; StructuredOutputError naming the problem for an invalid spec or one past
        the budget (budget.py)."""
        check_spec(params)
        kind = params.kind
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(params.json, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_regex("|".join(re.escape(c) for c in params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar reports a bad spec as RuntimeError (or its own errors)
            raise StructuredOutputError(f"invalid {kind} for structured output: {_first_line(exc)}") from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/file.cc:42: ")."""
    text = str(exc).strip().splitlines()
    return _LOG_PREFIX.sub("", text[0]) if text else type(exc).__name__


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:[0-9]+:\s*")
