"""The real server through the official `openai` client: completions, chat, streaming, auth; a PEFT adapter
uploaded over plain HTTP serves the same greedy tokens as transformers + PEFT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "platform"))
from app_fixtures import make_text_model  # noqa: E402
from factories import load_peft_reference, make_adapter, reference_greedy  # noqa: E402
from server_process import tiny_server_args  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "sk-e2e-admin"
PROMPT = [9, 8, 7, 6, 5]


def test_openai_client_and_adapter_upload(start_server, tmp_path):
    model_dir = make_text_model(tmp_path / "model")
    adapter_dir = make_adapter(
        model_dir,
        tmp_path / "helper",
        seed=6,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
    )
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY: {"tenant": "acme", "role": "admin"}}))
    server = start_server(tiny_server_args(model_dir, "--api-keys", str(keys)))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)

    completion = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5, temperature=0)
    assert completion.model == "tiny" and completion.usage.completion_tokens == 5
    streamed = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == completion.choices[0].text

    messages = [{"role": "user", "content": "What is the answer?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 6
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]

    with (
        (adapter_dir / "adapter_config.json").open("rb") as config,
        (adapter_dir / "adapter_model.safetensors").open("rb") as weights,
    ):
        upload = httpx.post(
            f"{server.url}/v1/adapters",
            headers={"authorization": f"Bearer {KEY}"},
            data={"name": "helper"},
            files=[
                ("files", ("adapter_config.json", config)),
                ("files", ("adapter_model.safetensors", weights)),
            ],
            timeout=60,
        )
    assert upload.status_code == 201, upload.text
    assert upload.json()["name"] == "helper" and upload.json()["version"] == 1

    raw = client.completions.with_raw_response.create(
        model="helper",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    served = raw.parse()
    assert served.model == "helper@1" and raw.headers["x-loraserve-variant"] == "helper@1"
    reference = reference_greedy(load_peft_reference(model_dir, {"helper": adapter_dir}), PROMPT, "helper", 8)
    assert served.choices[0].logprobs.tokens == [f"token_id:{t}" for t in reference]
    base = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert (
        base.choices[0].logprobs.tokens != served.choices[0].logprobs.tokens
    )  # the adapter changed the output

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nobody", prompt="x", max_tokens=1)
    assert httpx.get(f"{server.url}/metrics").status_code == 404  # tenants' port: no metrics
    metrics = httpx.get(f"{server.metrics_url}/metrics").text
    assert 'vllm:generation_tokens_total{model_name="tiny"}' in metrics
