"""What a structured-output spec may ask of the compiler, and the errors that name a bad spec.

xgrammar's cost grows steeply with a JSON schema's shape: turning 600 nested arrays into a grammar takes
about 40 s (cubic in the depth), and the token masks of a 20,000-value enum about 45 s for a 49k-token
vocabulary, while the request waits and, before, while every other tenant's requests waited too. So a
schema's shape is bounded before anything compiles (OpenAI's structured outputs bound schemas the same
way), and what passes compiles in about a second at most; the compile timeout of the engine
(`EngineConfig.grammar_compile_timeout_s`) is the backstop for the rest. Regexes and EBNF grammars
compile fast even with large repetition counts, but alternatives cost what enum values cost: they are
counted too; their text is bounded (params.MAX_SPEC_CHARS).

Keywords of a fixed JSON type given another (`properties` not an object, `required` not a list of names)
are refused here too, as the compiler would refuse them later.

Also refused here, since the schema's meaning would otherwise be lost without a word: a `$ref` that is
not a pointer into the schema itself ("#/$defs/Name") or that points nowhere (xgrammar takes a remote
or unresolvable reference as "any value"), and `$dynamicRef` / `$recursiveRef`, which it ignores.

Every error here is the caller's and carries a `code` the server answers 400 with.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from engine.core.request_checks import RequestError
from engine.structured_output.params import StructuredOutputsParams

MAX_SCHEMA_DEPTH = 64  # nested JSON objects and arrays in the schema document
MAX_SCHEMA_NODES = 4096  # JSON objects (sub-schemas and their keyword maps) in the schema document
MAX_ENUM_VALUES = 4096  # enum and const values in a schema, entries of a choice, alternatives of a regex
_UNSUPPORTED_REFS = ("$dynamicRef", "$recursiveRef")
_VALUES = frozenset({"enum", "const", "default", "examples"})  # keywords whose values are data, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class StructuredOutputError(RequestError):
    """A spec that cannot be served (the caller's to fix); `code` names the kind for the API."""

    code = "invalid_structured_output"


class SpecTooComplex(StructuredOutputError):
    code = "structured_output_too_complex"


class SpecUnsatisfiable(StructuredOutputError):
    """The spec, with the request's other restrictions, leaves no token to generate."""

    code = "structured_output_unsatisfiable"


def check_spec(params: StructuredOutputsParams) -> None:
    """Refuse, naming the problem, a spec too large to compile in bounded time or whose meaning the
    compiler would silently change. Cheap: no compiling, one pass over a schema."""
    if params.kind == "json":
        check_schema(parse_schema(params.json))
    elif params.kind == "choice" and len(params.choice) > MAX_ENUM_VALUES:
        raise SpecTooComplex(
            f"a choice of {len(params.choice)} entries is more than the {MAX_ENUM_VALUES} this server compiles; "
            "shorten the list"
        )
    elif params.kind in ("regex", "grammar"):
        text = params.regex if params.kind == "regex" else params.grammar
        # Alternatives cost what enum values cost (16,384 of them: 6 s); "|" counts them from above.
        if text.count("|") >= MAX_ENUM_VALUES:
            raise SpecTooComplex(
                f"the {params.kind} has more than {MAX_ENUM_VALUES} alternatives ('|'); shorten it"
            )
        if params.kind == "regex":
            try:
                re.compile(params.regex)
            except (re.error, RecursionError, OverflowError) as exc:
                raise StructuredOutputError(f"invalid regex for structured output: {exc}") from None


def parse_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError("a JSON schema must be an object (or true/false)")
    return schema


def check_schema(schema: Any) -> None:
    """Depth, size, enum values and references of a parsed schema (iteratively: no recursion limit)."""
    num_nodes = num_values = 0
    stack: list[tuple[Any, int, bool]] = [(schema, 1, False)]  # (node, depth, is a map of name -> schema)
    while stack:
        node, depth, is_map = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise SpecTooComplex(
                f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and arrays; flatten it"
            )
        if isinstance(node, list):
            stack.extend((item, depth + 1, False) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        num_nodes += 1
        if num_nodes > MAX_SCHEMA_NODES:
            raise SpecTooComplex(
                f"the JSON schema has more than {MAX_SCHEMA_NODES} objects (sub-schemas); simplify it"
            )
        if is_map:  # e.g. properties: its keys are names, its values schemas
            stack.extend((value, depth + 1, False) for value in node.values())
            continue
        enum = node.get("enum")
        num_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if num_values > MAX_ENUM_VALUES:
            raise SpecTooComplex(
                f"the JSON schema has more than {MAX_ENUM_VALUES} enum and const values; shorten its enums"
            )
        for keyword in _UNSUPPORTED_REFS:
            if keyword in node:
                raise StructuredOutputError(
                    f"the JSON schema uses {keyword}, which structured outputs do not support; use $ref"
                )
        if "$ref" in node:
            _check_ref(schema, node["$ref"])
        _check_keyword_types(node)
        for key, value in node.items():
            if key not in _VALUES:
                stack.append((value, depth + 1, key in _SCHEMA_MAPS))


def _check_keyword_types(node: dict) -> None:
    """Keywords whose value has a fixed JSON type: a wrong one is a broken schema (xgrammar refuses it
    while compiling, in the engine; here it is the caller's 400 before anything is queued)."""
    for key in _SCHEMA_MAPS:
        if key in node and not isinstance(node[key], dict):
            raise StructuredOutputError(f"the JSON schema's {key} must be an object of name -> schema")
    required = node.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise StructuredOutputError("the JSON schema's required must be a list of property names")


def _check_ref(root: Any, ref: Any) -> None:
    """A $ref must be a JSON pointer into the schema itself that resolves ("#", "#/$defs/Name")."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise StructuredOutputError(
            f"the JSON schema's $ref {str(ref)[:100]!r} cannot be resolved: only references into the schema "
            "itself, like '#/$defs/Name', are supported"
        )
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise StructuredOutputError(
                f"the JSON schema's $ref {ref[:100]!r} points to nothing in the schema; define what it names "
                "(e.g. under $defs)"
            )
    if not isinstance(node, dict | bool):
        raise StructuredOutputError(f"the JSON schema's $ref {ref[:100]!r} does not point to a schema")
