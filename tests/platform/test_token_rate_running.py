"""`max_tokens_per_minute` charges what a request uses while it runs: its prompt at admission, each
generated token when it is generated, in the window of that moment. A request that runs past a minute is
counted (the limiter's clock jumps 61 s after the first chunk of an n=16 chat stream with no max_tokens), GET
/v1/usage shows the real use, and the tenant's next request is a 429 with Retry-After while over."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from app_fixtures import MAX_MODEL_LEN, make_text_model, open_test_services
from loraserve.app import create_app
from loraserve.settings import ServerSettings
from loraserve.tenancy import TokenRateLimiter

LIMIT = 300
KEYS = {
    "sk-alice": {"tenant": "alice", "role": "admin", "max_tokens_per_minute": LIMIT},
    "sk-bob": {"tenant": "bob", "role": "admin"},
}
PROMPT = [7, 8, 9, 10, 11]
N = 16
# 93 tokens as a chat prompt: each completion has 35 tokens of context left, 560 in all (CI-sized)
STORY = "Hello world! The quick brown fox jumps over the lazy dog. " * 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("token-rate") / "model")


async def stream_with(app, body: dict, key: str, on_chunk) -> list[dict]:
    """POST a streaming chat completion over raw ASGI, calling `on_chunk()` once, at the first body chunk."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    sent: list[dict] = []
    delivered = False
    done = asyncio.Event()

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # the client stays until the response is over, then leaves (as servers report)
        return {"type": "http.disconnect"}

    async def send(message):
        if (
            message["type"] == "http.response.body"
            and message.get("body")
            and not any(m.get("body") for m in sent)
        ):
            on_chunk()
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=120)
    return sent


@pytest.mark.slow
def test_a_long_request_is_charged_as_it_generates_and_the_tenant_then_waits(tmp_path, model_dir):
    clock = Clock()
    before_jump: list[int] = []

    def jump():  # a minute passes after the first chunk: the rest is generated in the next window
        before_jump.append(limiter.used("alice"))
        clock.now += 61

    limiter = TokenRateLimiter(clock)

    async def main():
        async with open_test_services(tmp_path, model_dir, api_keys=KEYS, num_kv_blocks=600) as services:
            services.token_limiter = limiter
            app = create_app(ServerSettings(), services=services)
            async with (
                app.lifespan(),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://testserver"
                ) as client,
            ):
                # No max_tokens (chat's default): each of the 16 completions runs to the context's end.
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": STORY}],
                    "n": N,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                sent = await stream_with(app, body, "sk-alice", jump)
                after = limiter.used("alice")
                usage = await client.get("/v1/usage", headers={"authorization": "Bearer sk-alice"})
                small = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
                refused = await client.post(
                    "/v1/completions", json=small, headers={"authorization": "Bearer sk-alice"}
                )
                other = await client.post(
                    "/v1/completions", json=small, headers={"authorization": "Bearer sk-bob"}
                )
                return sent, after, usage, refused, other, services.limiter.in_flight("alice")

    sent, after, usage, refused, other, in_flight = asyncio.run(main())
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    prompt, generated = (events[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    assert generated == N * (MAX_MODEL_LEN - prompt)  # not cut: every completion ran to the end
    (charged_before,) = before_jump
    assert prompt <= charged_before < prompt + generated // 2
    # Everything generated after the jump is in the new window: the prompt and the first tokens left it.
    assert after == prompt + generated - charged_before
    assert after > LIMIT
    assert usage.json()["tokens_last_minute"] == after
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert other.status_code == 200  # another tenant is not held back
    assert in_flight == 0
