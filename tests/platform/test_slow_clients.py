"""Slow clients cannot hold connections, and SIGTERM during an upload answers with the 503 body.

A real uvicorn server on loopback (the server's own protocol and drain), raw sockets for the clients:
headers sent a line at a time, a body a byte at a time, a connection that never sends anything, each
gets 408 with OpenAI's error body and a closed connection once past its deadline; a large body at a
steady rate is never cut; an upload still arriving when the drain gives up gets 503 `server_shutting_down`
in JSON (it was uvicorn's plain-text 500).
"""

from __future__ import annotations

import json
import select
import signal
import threading
import time

import httpx
import pytest
from api_env import ADMIN_A, bearer
from live_server import live_server, read_response

ROUTE = b'{"variants": [{"adapter": "a", "weight": 1}]}'
FAST = dict(header_timeout_s=0.5, body_timeout_s=0.5, body_min_rate=1000)


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def _request_head(method: str, path: str, length: int, content_type: str = "application/json") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {ADMIN_A}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@pytest.mark.slow
def test_slow_headers_slow_bodies_and_silent_connections_get_408_and_are_closed(api_env, peft_adapters):
    env = api_env()
    env.services.adapter_store.put("alpha", "a", peft_adapters["qv"])  # what the routes below name
    with live_server(env.app, **FAST) as server:
        silent = server.connect()
        headers = server.connect()
        headers.sendall(b"PUT /v1/routes/r HTTP/1.1\r\nHost: test\r\n")
        body = server.connect()
        body.sendall(_request_head("PUT", "/v1/routes/r", len(ROUTE)))
        started = time.monotonic()
        for byte in ROUTE[:-1]:  # a byte every 0.2 s, far below 1000 bytes/s, until the server answers
            if select.select([body], [], [], 0.2)[0]:
                break
            body.sendall(bytes([byte]))
        answers = {name: read_response(sock) for name, sock in (("silent", silent), ("headers", headers))}
        answers["body"] = read_response(body)
        elapsed = time.monotonic() - started
        # A well-behaved client on the same server: keep-alive requests and a large body at a steady rate.
        with httpx.Client(base_url=server.url, headers=bearer(ADMIN_A)) as client:
            ok = [client.put("/v1/routes/r", content=ROUTE, headers={"content-type": "application/json"})]
            ok.append(client.get("/v1/routes/r"))
        steady = server.connect()
        padded = ROUTE[:-1] + b"," + b" " * 3000 + b'"sticky": "none"}'
        steady.sendall(_request_head("PUT", "/v1/routes/s", len(padded)))
        for start in range(0, len(padded), 500):  # 5,000 bytes/s, five times the minimum rate
            steady.sendall(padded[start : start + 500])
            time.sleep(0.1)
        steady_answer = read_response(steady, timeout_s=5)
    for name, raw in answers.items():
        status, error = _status_and_error(raw)
        assert status == 408 and error["code"] == "request_timeout", (name, raw)
        assert ("headers" if name != "body" else "body") in error["message"]
    assert elapsed < 5  # cut at about 0.5 s, not held until the client is done
    assert [r.status_code for r in ok] == [200, 200]
    assert steady_answer.startswith(b"HTTP/1.1 200"), steady_answer[:200]


def test_sigterm_while_an_upload_body_arrives_answers_with_the_503_body(api_env, peft_adapters):
    env = api_env()
    env.app.state["shutdown"].timeout_s = 0.3
    adapter = peft_adapters["qv"]
    boundary = "loraserve-test-boundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nslow\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="adapter_config.json"\r\n'
        f"Content-Type: application/json\r\n\r\n".encode()
        + (adapter / "adapter_config.json").read_bytes()
        + b"\r\n",
        f'--{boundary}\r\nContent-Disposition: form-data; name="files"; '
        f'filename="adapter_model.safetensors"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode()
        + (adapter / "adapter_model.safetensors").read_bytes()
        + b"\r\n",
        f"--{boundary}--\r\n".encode(),
    ]
    body = b"".join(parts)
    with live_server(env.app) as server:
        sock = server.connect()
        sock.sendall(
            _request_head("POST", "/v1/adapters", len(body), f"multipart/form-data; boundary={boundary}")
        )
        sock.sendall(body[: len(body) // 2])
        sending = threading.Event()

        def keep_sending() -> None:  # the rest, slowly, until the server answers or closes
            for start in range(len(body) // 2, len(body) - 10, 64):
                if sending.is_set():
                    return
                try:
                    sock.sendall(body[start : start + 64])
                except OSError:
                    return
                time.sleep(0.05)

        sender = threading.Thread(target=keep_sending, daemon=True)
        sender.start()
        time.sleep(0.3)
        server.server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on SIGTERM
        raw = read_response(sock, timeout_s=20)
        sending.set()
        sender.join(timeout=10)
    status, error = _status_and_error(raw)
    assert status == 503 and error["code"] == "server_shutting_down", raw[:300]
    assert b"content-type: application/json" in raw.lower()
