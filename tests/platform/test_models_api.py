"""GET /v1/models through the official `openai` client: vLLM's `root`, `parent` and `max_model_len`, with
an adapter's `root` naming the version that serves it (never a store path or another tenant)."""

from __future__ import annotations

import openai
import pytest
from app_fixtures import make_text_model
from factories import make_adapter
from test_inference_completions import run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("models") / "model")


@pytest.mark.slow
def test_models_list_as_vllm_shapes_it(tmp_path, model_dir):
    adapter = make_adapter(
        model_dir, tmp_path / "adapter", seed=4, r=4, lora_alpha=8, target_modules=["q_proj"]
    )

    async def scenario(client, services):
        services.adapter_store.put("default", "support", adapter)
        services.adapter_store.put("default", "support", adapter)
        api = openai.AsyncOpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0
        )
        return [m async for m in api.models.list()], services.max_model_len

    models, max_model_len = run(tmp_path, model_dir, scenario)
    by_id = {m.id: m for m in models}
    assert list(by_id) == ["tiny", "support", "support@1", "support@2"]
    base = by_id["tiny"]
    assert base.root == "tiny" and base.model_extra["parent"] is None
    assert base.model_extra["max_model_len"] == max_model_len
    for name, root in (("support", "support@2"), ("support@1", "support@1"), ("support@2", "support@2")):
        card = by_id[name].model_extra
        assert (card["root"], card["parent"], card["kind"]) == (root, "tiny", "adapter")
        assert card["max_model_len"] is None
    assert not any(str(tmp_path) in str(m.model_dump()) for m in models)
