"""Large bodies never stall the event loop: while huge prompts, prompt lists and chat histories are in
flight, /health (on the API port and on the metrics listener) keeps answering within a second.

Before, a 15 MiB prompt, 64 x 240 KB prompts or 10,000 chat messages were tokenized or templated on the
event loop before any limit, and /health went silent for 8-36 s. Now the body size is limited before
parsing, the message count at validation, and what is left runs on the work pool, where a text that
cannot fit the context is refused after tokenizing a short prefix.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow
HEALTH_BOUND_S = 1.0
WORDS = "the quick brown fox jumps over the lazy dog. "


def _text(num_bytes: int) -> str:
    return (WORDS * (num_bytes // len(WORDS) + 1))[:num_bytes]


def _large_requests(url: str) -> list[tuple[str, str, dict | bytes]]:
    chat = [{"role": "user", "content": _text(900)} for _ in range(4000)]  # at the message cap, ~3.7 MB
    return [
        ("one 3.8 MB prompt", "/v1/completions", {"model": "tiny", "prompt": _text(3_800_000)}),
        ("64 x 58 KB prompts", "/v1/completions", {"model": "tiny", "prompt": [_text(58_000)] * 64}),
        ("4,000 chat messages", "/v1/chat/completions", {"model": "tiny", "messages": chat}),
        (
            "10,000 chat messages",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 10_000},
        ),
        ("a 15 MiB prompt", "/v1/completions", {"model": "tiny", "prompt": _text(15 << 20)}),
        ("/tokenize of 3.8 MB", "/tokenize", {"prompt": _text(3_800_000)}),
    ]


def test_health_answers_within_a_second_while_large_bodies_are_in_flight(start_server, tmp_path):
    model_dir = make_text_model(tmp_path / "model")
    server = start_server(tiny_server_args(model_dir))
    requests = _large_requests(server.url)
    stop = threading.Event()
    latencies: dict[str, list[float]] = {server.url: [], server.metrics_url: []}

    def probe(base: str) -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            while not stop.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies[base].append(time.monotonic() - start)
                time.sleep(0.05)

    def send(item: tuple[str, str, dict]) -> tuple[str, int, str]:
        name, path, body = item
        with httpx.Client(base_url=server.url, timeout=120) as client:
            start = time.monotonic()
            response = client.post(path, json=body)
            print(f"{name}: {response.status_code} in {time.monotonic() - start:.1f} s")
            return name, response.status_code, response.text[:300]

    with ThreadPoolExecutor(len(latencies) + len(requests)) as pool:
        probes = [pool.submit(probe, base) for base in latencies]
        time.sleep(0.5)
        answers = list(pool.map(send, requests))
        stop.set()
        for done in probes:
            done.result()
    status = {name: code for name, code, _ in answers}
    assert status == {
        "one 3.8 MB prompt": 400,
        "64 x 58 KB prompts": 400,
        "4,000 chat messages": 400,
        "10,000 chat messages": 400,
        "a 15 MiB prompt": 413,
        "/tokenize of 3.8 MB": 400,
    }, answers
    for name, _code, text in answers:
        if name not in ("10,000 chat messages", "a 15 MiB prompt"):
            assert "context_length_exceeded" in text, (name, text)
    for base, seen in latencies.items():
        print(f"{base}/health: {len(seen)} probes, slowest {max(seen):.3f} s")
        assert len(seen) >= 5 and max(seen) < HEALTH_BOUND_S, (base, sorted(seen)[-5:])
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
