"""Bad input gets OpenAI's error body with the right 4xx, and the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from app_fixtures import MAX_MODEL_LEN, make_text_model
from loraserve.config_store import ConfigStoreError, ConfigStoreUnavailable
from loraserve.errors import _domain_error
from test_inference_completions import run

from adapters_store import StoreUnavailable
from engine import EngineDeadError

GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CASES = [
    # (path, raw body, status, code, words the message must contain)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid_json", ["JSON"]),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}',
        400,
        "invalid_request",
        ["max_tokens"],
    ),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "max_tokens": -3}',
        400,
        "invalid_request",
        [">= 0", "max_tokens"],  # completions take 0 with echo (the prompt scored)
    ),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "max_tokens": 0}',
        400,
        "invalid_request",
        ["at least 1", "echo", "max_tokens"],
    ),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "temperature": 3}',
        400,
        "invalid_request",
        ["temperature"],
    ),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "invalid_request", ["n"]),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "logprobs": 50}',
        400,
        "invalid_request",
        ["logprobs"],
    ),
    ("/v1/completions", b'{"model": "tiny"}', 400, "invalid_request", ["prompt"]),
    ("/v1/completions", b'{"model": "tiny", "prompt": []}', 400, "invalid_request", ["prompt"]),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, "a"]}', 400, "invalid_request", ["prompt"]),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "stop": ["a", ""]}',
        400,
        "invalid_request",
        ["stop"],
    ),
    (
        "/v1/completions",
        b'{"model": "no-such-model", "prompt": "x"}',
        404,
        "model_not_found",
        ["no-such-model"],
    ),
    (
        "/v1/completions",
        b'{"model": "../etc/passwd", "prompt": "x"}',
        404,
        "model_not_found",
        ["does not exist"],
    ),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "invalid_request", ["messages"]),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "", "content": "x"}]}',
        400,
        "invalid_request",
        ["role"],
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        400,
        None,
        ["logprobs"],
    ),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_request", ["object"]),
    (
        "/v1/completions",
        b'{"model": "tiny", "prompt": "x", "stream_options": {"include_usage": true}}',
        400,
        "invalid_request",
        ["stream_options", "stream"],
    ),
    # A seed must be a 64-bit integer, as in vLLM; larger ones once stopped the engine for everyone.
    *[
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": ' + seed + b"}", 400, None, [word])
        for seed, word in (
            (b"18446744073709551616", "seed"),
            (b"9223372036854775808", "seed"),
            (b"-9223372036854775809", "seed"),
            (b"1" * 5000, "out of range"),  # too wide for msgspec's JSON reader itself
        )
    ],
    # Bodies nested beyond any real request's depth are refused, not a recursion crash.
    *[
        (path, b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}", 400, "invalid_json", [])
        for path in ("/v1/completions", "/v1/chat/completions")
        for depth in (1_000, 100_000)
    ],
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x", "name": ' + b"{" * 5000 + b"}",
        400,
        "invalid_json",
        [],
    ),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("errors") / "model")


@pytest.mark.slow
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(tmp_path, model_dir):
    async def scenario(client, services):
        answers = []
        for path, body, *_ in CASES:
            answers.append(
                await client.post(path, content=body, headers={"content-type": "application/json"})
            )
        return answers, await client.post("/v1/completions", json=GOOD)

    answers, after = run(tmp_path, model_dir, scenario)
    for (_, body, status, code, words), response in zip(CASES, answers):
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "code"}
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        if code is not None:
            assert error["code"] == code, (body, error)
        for word in words:
            assert word in error["message"], (body, error["message"])
    assert after.status_code == 200


@pytest.mark.slow
def test_oversize_prompt_is_400_with_the_limit(tmp_path, model_dir):
    async def scenario(client, services):
        too_long = {"model": "tiny", "prompt": list(range(1, MAX_MODEL_LEN + 5))}
        return await client.post("/v1/completions", json=too_long)

    response = run(tmp_path, model_dir, scenario)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.slow
def test_unknown_path_wrong_method_and_oversize_body(tmp_path, model_dir):
    async def scenario(client, services):
        missing = await client.get("/v1/nope")
        wrong_method = await client.get("/v1/chat/completions")
        huge = await client.post(
            "/v1/completions",
            content=b'{"prompt": "' + b"a" * (17 << 20) + b'"}',
            headers={"content-type": "application/json"},
        )
        return missing, wrong_method, huge, await client.post("/v1/completions", json=GOOD)

    missing, wrong_method, huge, after = run(tmp_path, model_dir, scenario)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    assert after.status_code == 200


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (
            ConfigStoreUnavailable(
                "redis config store at redis://10.1.2.3:6379/0 unreachable: ConnectionError: Error 111"
            ),
            503,
            "config_store_unavailable",
        ),
        (
            ConfigStoreError("config record '/var/lib/loraserve/config/keys/ab.json' is corrupt"),
            500,
            "config_store_error",
        ),
        (
            StoreUnavailable(
                "list adapters of acme failed: EndpointConnectionError: http://10.9.9.9:9000/secret-bucket; "
                "bucket 'secret-bucket' does not exist"
            ),
            503,
            "store_unavailable",
        ),
        (
            EngineDeadError("the engine stopped: CUDA error at /opt/loraserve/engine/x.py:12"),
            503,
            "engine_dead",
        ),
    ],
)
def test_server_side_failures_name_no_address_bucket_or_path(exc, status, code, caplog):
    """The caller learns which part failed and to retry; the log keeps the details for the operator."""
    request = SimpleNamespace(method="GET", url=SimpleNamespace(path="/v1/models"))
    response = _domain_error(request, exc)
    body = msgspec.json.decode(msgspec.json.encode(response.content))
    assert response.status_code == status and body["error"]["code"] == code
    message = body["error"]["message"]
    for secret in ("10.", "6379", "9000", "secret-bucket", "/var/lib", "/opt", "redis://"):
        assert secret not in message
    assert "retry" in message or "log" in message
    assert str(exc) in caplog.text


@pytest.mark.slow
def test_a_bad_seed_mid_batch_leaves_other_streams_and_the_engine_alone(tmp_path, model_dir):
    """A seed torch would refuse once stopped the engine for every tenant: now it is a 400 of its own,
    the streams around it finish, and /health stays 200."""
    stream_body = {"model": "tiny", "prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "stream": True}

    async def scenario(client, services):
        streams = [asyncio.create_task(client.post("/v1/completions", json=stream_body)) for _ in range(3)]
        bad = await client.post("/v1/completions", json={**GOOD, "seed": 2**64, "temperature": 1.0})
        finished = await asyncio.wait_for(asyncio.gather(*streams), timeout=60)
        return bad, finished, await client.get("/health"), await client.post("/v1/completions", json=GOOD)

    bad, finished, health, after = run(tmp_path, model_dir, scenario)
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]
    for response in finished:
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text
    assert health.status_code == 200 and after.status_code == 200


@pytest.mark.slow
def test_health_turns_503_when_the_engine_is_dead(tmp_path, model_dir):
    async def scenario(client, services):
        before = await client.get("/health")
        # As if the core process had died (tests/platform/test_engine_core_death.py kills it for real).
        services.engine._client.dead_error = EngineDeadError("simulated")
        try:
            return before, await client.get("/health"), await client.get("/ready")
        finally:
            services.engine._client.dead_error = None

    before, dead, ready = run(tmp_path, model_dir, scenario)
    assert before.status_code == 200
    assert dead.status_code == 503 and ready.status_code == 503


@pytest.mark.slow
def test_a_body_that_is_not_declared_json_is_refused(tmp_path, model_dir):
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'

    async def scenario(client, services):
        answers = []
        for content_type in ("text/plain", None, "application/x-www-form-urlencoded"):
            headers = {"content-type": content_type} if content_type else {}
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/invocations"):
                answers.append(await client.post(path, content=body, headers=headers))
        ok = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
        )
        return answers, ok

    answers, ok = run(tmp_path, model_dir, scenario)
    for response in answers:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert ok.status_code == 200


def test_a_recursion_error_outside_body_decoding_is_a_500_not_a_400():
    from types import SimpleNamespace

    from litestar.serialization.msgspec_hooks import decode_json
    from loraserve.errors import _undecodable_body

    request = SimpleNamespace(method="POST", url=SimpleNamespace(path="/v1/completions"))

    def recurse(n):
        return recurse(n + 1)

    answers = []
    for raise_it in (lambda: decode_json(b"[" * 100_000 + b"]" * 100_000), lambda: recurse(0)):
        try:
            raise_it()
        except RecursionError as exc:
            answers.append(_undecodable_body(request, exc).status_code)
    assert answers == [400, 500]
