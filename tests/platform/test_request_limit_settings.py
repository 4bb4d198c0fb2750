"""The request-limit flags: defaults (the body limit follows the context), environment variables,
validation, and that they reach the app, uvicorn's protocol and the engine's config."""

from __future__ import annotations

import pytest
from loraserve.app import create_app
from loraserve.bootstrap import engine_config
from loraserve.cli import build_parser, settings_from_args
from loraserve.ops.http_timeouts import BoundedH11Protocol, bounded_h11_protocol
from loraserve.settings import ServerSettings


def settings(argv, env=None):
    return settings_from_args(build_parser(env or {}).parse_args(["serve", *argv]))


def test_defaults_environment_and_flags():
    default = settings([])
    assert default.request_body_limit == 4 << 20  # a 128k context's worth
    assert settings(["--max-model-len", "262144"]).request_body_limit == 8 << 20
    assert (
        default.tokenizer_pool_size,
        default.grammar_compile_threads,
        default.grammar_compile_timeout_s,
    ) == (
        2,
        2,
        10.0,
    )
    assert (default.http_header_timeout, default.http_body_timeout, default.http_body_min_rate) == (
        20.0,
        30.0,
        16384,
    )
    env = {
        "LORASERVE_MAX_REQUEST_BODY_SIZE": "1000000",
        "LORASERVE_TOKENIZER_POOL_SIZE": "3",
        "LORASERVE_HTTP_HEADER_TIMEOUT": "5",
        "LORASERVE_GRAMMAR_COMPILE_TIMEOUT": "2.5",
    }
    from_env = settings([], env)
    assert from_env.request_body_limit == 1_000_000 and from_env.tokenizer_pool_size == 3
    assert from_env.http_header_timeout == 5.0 and from_env.grammar_compile_timeout_s == 2.5
    assert settings(["--tokenizer-pool-size", "4"], env).tokenizer_pool_size == 4  # the flag wins
    config = engine_config(settings(["--grammar-compile-threads", "3"], env), "some-model")
    assert (config.grammar_compile_threads, config.grammar_compile_timeout_s) == (3, 2.5)


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"max_request_body_size": 100}, "--max-request-body-size"),
        ({"tokenizer_pool_size": 0}, "--tokenizer-pool-size"),
        ({"http_header_timeout": 0}, "--http-header-timeout"),
        ({"http_body_timeout": -1}, "--http-body-timeout"),
        ({"http_body_min_rate": 0}, "--http-body-min-rate"),
        ({"grammar_compile_threads": 0}, "--grammar-compile-threads"),
        ({"grammar_compile_timeout_s": 0}, "--grammar-compile-timeout"),
    ],
)
def test_bad_values_name_their_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        ServerSettings(**fields)


def test_the_limits_reach_the_app_and_the_protocol():
    app = create_app(ServerSettings(max_request_body_size=123456))
    assert app.request_max_body_size == 123456
    protocol = bounded_h11_protocol(1.5, 2.5, 100)
    assert issubclass(protocol, BoundedH11Protocol)
    assert (protocol.header_timeout_s, protocol.body_timeout_s, protocol.body_min_rate) == (1.5, 2.5, 100)
    with pytest.raises(ValueError, match="header timeout"):
        bounded_h11_protocol(0, 1, 1)
