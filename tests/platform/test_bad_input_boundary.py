"""Bad input at the HTTP boundary is the caller's 4xx, naming the field, never a 500 (hardening round 2).

Each case was a 500 (or silently accepted) before: invalid UTF-8 inside a JSON body, integers wider than
the engine's 64 bits, a NUL byte in a path, a logit_bias key in another script's digits, two
Authorization headers (a proxy could check one while the server read the other).
"""

from __future__ import annotations

import pytest
from app_fixtures import keys_for, make_text_model
from test_inference_completions import run

from engine import RequestError, SamplingParams

JSON = {"content-type": "application/json"}
ADMIN = {"authorization": "Bearer sk-admin", **JSON}
KEYS = keys_for(acme=("sk-admin", "admin", None))
CHAT = '"messages": [{"role": "user", "content": "x"}]'
# One body per JSON endpoint, each with a string holding the byte 0xff (not UTF-8).
INVALID_UTF8 = [
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}'),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}'),
    ("POST", "/tokenize", b'{"prompt": "\xff"}'),
    ("POST", "/detokenize", b'{"tokens": [1], "model": "\xff"}'),
    ("POST", "/invocations", b'{"prompt": "\xff", "model": "tiny"}'),
    ("POST", "/v1/load_lora_adapter", b'{"lora_name": "a", "lora_path": "\xff"}'),
    ("POST", "/v1/unload_lora_adapter", b'{"lora_name": "\xff"}'),
]
WIDE = [2**64, 2**63, 2**64 - 1, -(2**64)]
# (endpoint, field, value as JSON text): integers no 64-bit field carries
WIDE_INTEGERS = [
    *[
        ("/v1/completions", field, str(value))
        for field in ("max_tokens", "min_tokens", "top_k")
        for value in WIDE
    ],
    ("/v1/chat/completions", "max_completion_tokens", str(2**64)),
    ("/v1/chat/completions", "max_tokens", str(2**64)),
    ("/v1/completions", "stop_token_ids", f"[{2**64}]"),
    ("/v1/completions", "allowed_token_ids", f"[{2**64}]"),
    ("/v1/completions", "truncate_prompt_tokens", str(2**64)),
    ("/v1/completions", "logprobs", str(2**64)),
    ("/v1/completions", "prompt_logprobs", str(-(2**64))),
    ("/v1/chat/completions", "top_logprobs", str(2**64)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("boundary") / "model")


@pytest.mark.slow
def test_invalid_utf8_wide_integers_and_odd_keys_are_400s_naming_the_field(tmp_path, model_dir):
    allowed = tmp_path / "allowed"
    allowed.mkdir()

    async def scenario(client, services):
        services.allowed_lora_paths = (str(allowed),)
        utf8 = [
            await client.request(method, path, content=body, headers=ADMIN)
            for method, path, body in INVALID_UTF8
        ]
        wide = []
        for path, field, value in WIDE_INTEGERS:
            start = '{"model": "tiny", ' + (CHAT if "chat" in path else '"prompt": "x"')
            body = f'{start}, "{field}": {value}}}'.encode()
            wide.append((field, await client.post(path, content=body, headers=ADMIN)))
        odd = {
            "nul_path": await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "a", "lora_path": f"{allowed}/a\x00b"},
                headers=ADMIN,
            ),
            "long_path": await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "a", "lora_path": f"{allowed}/" + "a" * 5000},
                headers=ADMIN,
            ),
            "long_name": await client.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "a", "lora_path": f"{allowed}/" + "a" * 300},
                headers=ADMIN,
            ),
        }
        for name, key in (("arabic_digit", "\u0661"), ("superscript", "\u00b2"), ("huge_key", "9" * 5000)):
            body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "logit_bias": {key: 5}}
            odd[name] = await client.post("/v1/completions", json=body, headers=ADMIN)
        after = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, headers=ADMIN
        )
        return utf8, wide, odd, after

    utf8, wide, odd, after = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    for response in utf8:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and "UTF-8" in error["message"]
    for field, response in wide:
        assert response.status_code == 400, (field, response.text)
        assert field in response.json()["error"]["message"], (field, response.text)
    for name, response in odd.items():
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == ("lora_path" if name.endswith(("_path", "_name")) else "logit_bias"), name
    assert after.status_code == 200


@pytest.mark.slow
def test_an_integer_the_engine_cannot_carry_is_a_request_error_not_a_crash(tmp_path, model_dir):
    """The engine's own boundary: params wider than its messages fail that request as a RequestError."""

    async def scenario(client, services):
        stream = services.engine.generate([1, 2, 3], SamplingParams(max_tokens=2, top_k=2**64), "wide")
        with pytest.raises(RequestError, match="cannot take"):
            async for _ in stream:
                pass
        return await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})

    assert run(tmp_path, model_dir, scenario).status_code == 200


@pytest.mark.slow
def test_two_authorization_headers_are_refused(tmp_path, model_dir):
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'

    async def scenario(client, services):
        twice = [
            ("authorization", "Bearer sk-admin"),
            ("authorization", "Bearer sk-admin"),
            ("content-type", "application/json"),
        ]
        other_first = [("authorization", "Bearer nope"), *twice[1:]]
        return [
            await client.post("/v1/completions", content=body, headers=headers)
            for headers in (twice, other_first, ADMIN)
        ]

    twice, other_first, once = run(tmp_path, model_dir, scenario, api_keys=KEYS)
    for response in (twice, other_first):
        assert response.status_code == 401, response.text
        assert "2 Authorization headers" in response.json()["error"]["message"]
    assert once.status_code == 200
