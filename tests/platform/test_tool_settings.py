"""Where tool-call parsers are set: the server's vLLM flags, and an adapter's record (upload form, CLI)."""

from __future__ import annotations

import json

import pytest
from api_env import ADMIN_A
from litestar.testing import TestClient
from loraserve import cli_client
from loraserve.cli import build_parser, settings_from_args

from adapters_store import AdapterRecord


def settings(argv, env=None):
    return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))


def test_auto_tool_choice_flags_and_environment():
    assert settings([]).auto_tool_call_parser is None
    assert settings(["--tool-call-parser", "hermes"]).auto_tool_call_parser is None  # needs the switch too
    on = settings(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert (on.enable_auto_tool_choice, on.auto_tool_call_parser) == (True, "llama3_json")
    env = {"LORASERVE_ENABLE_AUTO_TOOL_CHOICE": "true", "LORASERVE_TOOL_CALL_PARSER": "pythonic"}
    assert settings([], env).auto_tool_call_parser == "pythonic"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tool-call-parser", "qwen"],
            "invalid tool call parser: qwen (chose from { hermes,llama3_json,mistral,pythonic })",
        ),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    ],
)
def test_bad_tool_flags_stop_the_start(argv, message):
    with pytest.raises(ValueError) as error:
        settings(argv)
    assert message in str(error.value)


def test_the_cli_uploads_an_adapter_with_its_parser(api_env, peft_adapters, capsys, monkeypatch):
    monkeypatch.setenv(cli_client.KEY_ENV, ADMIN_A)
    with TestClient(api_env().app) as client:
        argv = ["adapters", "upload", "caller", str(peft_adapters["qv"]), "--tool-call-parser", "mistral"]
        assert cli_client.main(argv, client=client) == 0
        assert json.loads(capsys.readouterr().out)["tool_call_parser"] == "mistral"
        assert cli_client.main(["adapters", "get", "caller@1"], client=client) == 0
        assert json.loads(capsys.readouterr().out)["tool_call_parser"] == "mistral"
        argv[-1] = "xml"
        assert cli_client.main(argv, client=client) == 1
        assert (
            "HTTP 422 (bad_upload): tool_call_parser 'xml' is not one of the parsers"
            in capsys.readouterr().err
        )


def test_the_record_keeps_the_parser_in_its_manifest():
    fields = dict(
        name="a",
        version=1,
        rank=8,
        alpha=16.0,
        target_modules=("q_proj",),
        base_model=None,
        sha256="0" * 64,
        size_bytes=1,
        created_at="2026-01-01T00:00:00Z",
    )
    plain = AdapterRecord(**fields)
    assert "tool_call_parser" not in json.loads(plain.to_json())  # older readers see what they knew
    assert AdapterRecord.from_json(plain.to_json()) == plain
    caller = AdapterRecord(**fields, tool_call_parser="hermes")
    assert AdapterRecord.from_json(caller.to_json()) == caller
    bad = json.dumps({**json.loads(plain.to_json()), "tool_call_parser": "a b"}).encode()
    with pytest.raises(ValueError, match="tool_call_parser"):
        AdapterRecord.from_json(bad)
