"""Grammars compile off the step loop, once per spec, within a time budget; a grammar that leaves no token
to generate fails its request alone, with an error code that marks it as the caller's.

Before, each request's grammar compiled inside `add_request` on the step loop: a 40 s compile stalled
every running request. Compiles are slowed down here on purpose (a patched compiler) to see the loop
keep stepping while they run.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.structured_output import grammars as grammars_module
from engine.structured_output.budget import MAX_ENUM_VALUES, MAX_SCHEMA_DEPTH, check_spec

FREE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def constrained(**spec) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def llm(text_model_dir):
    engine_llm = LLM(
        model=str(text_model_dir),
        max_model_len=96,
        block_size=4,
        max_num_seqs=8,
        grammar_compile_timeout_s=5.0,
    )
    yield engine_llm
    engine_llm.engine.shutdown()


@pytest.fixture
def slow_compiles(monkeypatch):
    """A compile of a spec with "slow" in it sleeps 3 s first, with "glacial" 12 s; counts compiles by spec."""
    counts: dict[str, int] = {}
    lock = threading.Lock()
    original = grammars_module.GrammarCompiler.compile

    def compile_slowly(self, params):
        with lock:
            counts[params.spec_text] = counts.get(params.spec_text, 0) + 1
        text = params.spec_text or ""
        time.sleep(3.0 if "slow" in text else 12.0 if "glacial" in text else 0.0)
        compiled = original(self, params)
        counts[f"done: {text}"] = time.monotonic()
        return compiled

    monkeypatch.setattr(grammars_module.GrammarCompiler, "compile", compile_slowly)
    return counts


def test_the_loop_keeps_stepping_while_a_grammar_compiles(llm, slow_compiles):
    engine = llm.engine
    engine.add_request("structured", "Pick:", constrained(regex="(slow|fast)"))
    engine.add_request("free", "Hello", FREE)
    finished_at: dict[str, float] = {}
    start = time.monotonic()
    while engine.has_unfinished_requests() and time.monotonic() - start < 60:
        for output in engine.step():
            if output.finished:
                finished_at[output.request_id] = time.monotonic()
                assert output.error is None, output.error
    # The free request ran to the end while the grammar was still compiling (3 s).
    compiled_at = slow_compiles["done: (slow|fast)"]
    assert finished_at["free"] < compiled_at < finished_at["structured"], (finished_at, compiled_at)


@pytest.mark.slow
def test_one_compile_per_spec_and_a_budget_in_time(llm, slow_compiles):
    same = constrained(regex="(yes|no) please")
    outputs = llm.generate(["A", "B", "C"], [same, same, SamplingParams(n=2, **_fields(same))])
    assert all(o.error is None for o in outputs)
    assert slow_compiles["(yes|no) please"] == 1  # three requests, one with n=2: one compile

    too_slow = constrained(regex="glacial+")
    started = time.monotonic()
    first, again = llm.generate(["A", "B"], [too_slow, too_slow])
    for output in (first, again):
        assert output.outputs[0].finish_reason == "error"
        assert output.error_code == "structured_output_too_complex" and "longer than 5 s" in output.error
    assert time.monotonic() - started < 11  # failed at the 5 s budget, not after the 12 s compile
    (later,) = llm.generate(["C"], [too_slow])  # remembered: refused at once, no second compile
    assert later.error_code == "structured_output_too_complex"
    assert slow_compiles["glacial+"] == 1


@pytest.mark.parametrize(
    "spec, params, words",
    [
        ({"grammar": 'root ::= [^\\x00-\\U0010FFFF] "x"'}, {}, ["no token", "empty"]),
        ({"json": {"$ref": "#"}}, {}, ["no token"]),
        ({"regex": "zzzz"}, {"allowed_token_ids": [3, 4]}, ["allowed_token_ids"]),
        ({"choice": ["a"]}, {"min_tokens": 5, "max_tokens": 8}, ["min_tokens=5", "lower min_tokens"]),
    ],
)
def test_a_grammar_that_leaves_no_token_fails_its_request_alone(llm, spec, params, words):
    bad = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(**spec), **params)
    bad_output, good_output = llm.generate(["Hello", "Hello"], [bad, FREE])
    assert bad_output.outputs[0].finish_reason == "error"
    assert bad_output.error_code == "structured_output_unsatisfiable", bad_output.error
    for word in words:
        assert word in bad_output.error
    assert good_output.error is None and len(good_output.outputs[0].token_ids) == 6


def test_min_tokens_is_honoured_where_the_grammar_allows_more(llm):
    params = SamplingParams(
        temperature=0.0, min_tokens=5, max_tokens=10, structured_outputs={"regex": "[ab]+"}
    )
    (output,) = llm.generate(["Hello"], [params])
    assert output.error is None
    assert len(output.outputs[0].token_ids) >= 5
    assert set(output.outputs[0].text) <= {"a", "b"}


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "spec, code, words",
    [
        ({"json": _nested_arrays(MAX_SCHEMA_DEPTH)}, "structured_output_too_complex", ["deeper than"]),
        ({"json": {"enum": list(range(MAX_ENUM_VALUES + 1))}}, "structured_output_too_complex", ["enum"]),
        (
            {"choice": [str(i) for i in range(MAX_ENUM_VALUES + 1)]},
            "structured_output_too_complex",
            ["choice"],
        ),
        ({"json": {"$ref": "https://example.com/s.json"}}, "invalid_structured_output", ["$ref", "resolved"]),
        ({"json": {"$ref": "#anchor"}}, "invalid_structured_output", ["$ref"]),
        (
            {"json": {"properties": {"a": {"$ref": "#/$defs/B"}}, "$defs": {}}},
            "invalid_structured_output",
            ["points to nothing"],
        ),
        ({"json": {"$dynamicRef": "#x"}}, "invalid_structured_output", ["$dynamicRef"]),
        ({"json": '{"a": '}, "invalid_structured_output", ["not valid JSON"]),
        ({"regex": "(unclosed"}, "invalid_structured_output", ["regex"]),
        (
            {"regex": "|".join(str(i) for i in range(MAX_ENUM_VALUES + 1))},
            "structured_output_too_complex",
            ["alternatives"],
        ),
        (
            {"grammar": "root ::= " + " | ".join(f'"{i}"' for i in range(MAX_ENUM_VALUES + 1))},
            "structured_output_too_complex",
            ["alternatives"],
        ),
    ],
)
def test_the_budget_refuses_specs_before_anything_compiles(spec, code, words):
    with pytest.raises(ValueError) as error:
        check_spec(StructuredOutputsParams(**spec))
    assert error.value.code == code
    for word in words:
        assert word in str(error.value)


def test_the_budget_passes_what_compiles_fast_and_references_that_resolve():
    check_spec(StructuredOutputsParams(json=_nested_arrays(MAX_SCHEMA_DEPTH // 2)))
    schema = {
        "type": "object",
        "properties": {"default": {"$ref": "#/$defs/Item"}, "enum": {"type": "string"}},
        "$defs": {"Item": {"type": "array", "items": {"$ref": "#/$defs/Leaf"}}, "Leaf": {"const": 1}},
    }
    check_spec(StructuredOutputsParams(json=schema))
    check_spec(StructuredOutputsParams(choice=[str(i) for i in range(MAX_ENUM_VALUES)]))
    with pytest.raises(ValueError, match="points to nothing"):
        check_spec(StructuredOutputsParams(json={**schema, "$defs": {"Item": {"$ref": "#/$defs/Gone"}}}))


def _fields(params: SamplingParams) -> dict:
    return {
        "temperature": params.temperature,
        "max_tokens": params.max_tokens,
        "structured_outputs": params.structured_outputs,
    }
