"""The server on a Phi-3 model (fused qkv_proj / gate_up_proj): its chat template, a PEFT adapter of its
form uploaded over HTTP and served in a chat completion that equals transformers + PEFT, and an adapter
of the Llama form refused with a 422 naming the form that fits."""

from __future__ import annotations

import pytest
from app_fixtures import make_text_model, make_tokenizer
from factories import load_peft_reference, make_adapter, reference_greedy
from test_inference_completions import run

MESSAGES = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3-api")
    model_dir = make_text_model(root / "model", arch="phi3")
    fused = make_adapter(model_dir, root / "fused", seed=3, r=8, target_modules=["qkv_proj", "gate_up_proj"])
    return model_dir, fused


def files(folder) -> list:
    return [
        ("files", (name, (folder / name).read_bytes()))
        for name in ("adapter_config.json", "adapter_model.safetensors")
    ]


@pytest.mark.slow
def test_a_phi3_adapter_uploaded_and_served(tmp_path, phi, make_llama_style_adapter):
    model_dir, fused = phi
    tokenizer = make_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    expected = reference_greedy(load_peft_reference(model_dir, {"fused": fused}), prompt_ids, "fused", 6)

    async def scenario(client, services):
        created = await client.post("/v1/adapters", data={"name": "phi-bot"}, files=files(fused))
        refused = await client.post(
            "/v1/adapters", data={"name": "llama-bot"}, files=files(make_llama_style_adapter)
        )
        body = {
            "model": "phi-bot",
            "messages": MESSAGES,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        return created, refused, await client.post("/v1/chat/completions", json=body)

    created, refused, completion = run(tmp_path, model_dir, scenario)
    assert created.status_code == 201, created.text
    assert created.json()["target_modules"] == ["qkv_proj", "gate_up_proj"]
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert "stores q_proj, k_proj, v_proj fused as qkv_proj" in error["message"]
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["message"]["content"] == tokenizer.decode(expected)


@pytest.fixture(scope="module")
def make_llama_style_adapter(tmp_path_factory):
    """An adapter of the Llama form (q_proj, v_proj), trained on a Llama of the same sizes."""
    root = tmp_path_factory.mktemp("llama-style")
    llama = make_text_model(root / "model")
    return make_adapter(llama, root / "adapter", seed=4, r=8, target_modules=["q_proj", "v_proj"])
