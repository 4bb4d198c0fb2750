"""The server on a Qwen3-MoE model (the issue's new user): a PEFT adapter on attention and the routed
experts (target_parameters) uploaded over HTTP and served in a chat completion that equals
transformers + PEFT; target_parameters naming a parameter the model lacks is refused with a 422."""

from __future__ import annotations

import json

import pytest
from app_fixtures import make_text_model, make_tokenizer
from factories import EXPERTS, make_adapter, per_adapter_reference
from test_inference_completions import run

MESSAGES = [{"role": "user", "content": "What is the answer?"}]


def files(folder, config=None) -> list:
    text = config if config is not None else (folder / "adapter_config.json").read_text()
    return [
        ("files", ("adapter_config.json", text.encode())),
        ("files", ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes())),
    ]


@pytest.mark.slow
def test_an_expert_adapter_uploaded_and_served(tmp_path):
    import torch

    model_dir = make_text_model(tmp_path / "model", arch="qwen3_moe")
    adapter = make_adapter(
        model_dir,
        tmp_path / "adapter",
        seed=3,
        r=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=EXPERTS,
    )
    tokenizer = make_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    reference = per_adapter_reference(model_dir, {"experts": adapter})["experts"]
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
            min_new_tokens=6, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(prompt_ids) :].tolist()
    bad = json.loads((adapter / "adapter_config.json").read_text())
    bad["target_parameters"] = ["mlp.experts.w1"]

    async def scenario(client, services):
        created = await client.post("/v1/adapters", data={"name": "moe-bot"}, files=files(adapter))
        refused = await client.post(
            "/v1/adapters", data={"name": "bad"}, files=files(adapter, json.dumps(bad))
        )
        body = {
            "model": "moe-bot",
            "messages": MESSAGES,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        return created, refused, await client.post("/v1/chat/completions", json=body)

    created, refused, completion = run(tmp_path, model_dir, scenario)
    assert created.status_code == 201, created.text
    assert created.json()["target_modules"] == [
        "q_proj",
        "v_proj",
        "experts.gate_up_proj",
        "experts.down_proj",
    ]
    assert refused.status_code == 422
    assert "mlp.experts.gate_up_proj" in refused.json()["error"]["message"]
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["message"]["content"] == tokenizer.decode(expected)
