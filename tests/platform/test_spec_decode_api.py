"""Speculative decoding through the server: `--speculative-config` reaches the engine (bad JSON stops the
start naming the flag), completions and chat accept the `speculative` extension (anything but a bool is a
400), and /metrics carries vLLM's spec_decode counters."""

from __future__ import annotations

import json

import pytest
from app_fixtures import make_text_model
from loraserve.bootstrap import engine_config
from loraserve.cli import build_parser, settings_from_args
from loraserve.ops.metrics import Metrics
from test_app_metrics import METRICS_URL, engine_stats, samples, value
from test_inference_completions import run

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.stats import SpecDecodeStats

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
# Many distinct tokens: whatever the model generates next has most likely occurred before.
PROMPT = list(range(3, 119))  # 116 tokens: with max_tokens 12, exactly the 128-token context


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_text_model(tmp_path_factory.mktemp("spec-api") / "model")


def _settings(argv):
    return settings_from_args(build_parser({}).parse_args(["serve", *argv]))


def test_flag_reaches_the_engine():
    settings = _settings(["--speculative-config", json.dumps(NGRAM)])
    config = engine_config(settings, "some-model").speculative_config
    assert config == SpeculativeConfig(**NGRAM)
    assert engine_config(_settings([]), "some-model").speculative_config is None


@pytest.mark.parametrize(
    "raw, words",
    [
        ("{nope", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "n": 1}', "unknown keys"),
    ],
)
def test_bad_flag_names_it(raw, words):
    with pytest.raises(ValueError, match=f"--speculative-config: .*{words}"):
        _settings(["--speculative-config", raw])


def test_metrics_use_vllms_names():
    stats = engine_stats(running=(), waiting=())
    stats = type(stats)(**{**stats.__dict__, "spec_decode": SpecDecodeStats(4, 12, 7, (4, 2, 1))})
    text = Metrics("tiny", engine_stats=lambda: stats).render().decode()
    found = samples(text)
    assert value(found, "vllm:spec_decode_num_drafts_total", model_name="tiny") == 4
    assert value(found, "vllm:spec_decode_num_draft_tokens_total", model_name="tiny") == 12
    assert value(found, "vllm:spec_decode_num_accepted_tokens_total", model_name="tiny") == 7
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(found, per_pos, model_name="tiny", position=str(i)) for i in range(3)] == [4, 2, 1]
    # Without speculation the families are absent, as in vLLM.
    plain = samples(Metrics("tiny", engine_stats=lambda: engine_stats((), ())).render().decode())
    assert not any(name.startswith("vllm:spec_decode") for name, _ in plain)


@pytest.mark.slow
def test_requests_opt_out_and_in(tmp_path, model_dir):
    async def scenario(client, services):
        async def drafts() -> float:
            found = samples((await client.get(METRICS_URL)).text)
            return value(found, "vllm:spec_decode_num_drafts_total", model_name="tiny")

        base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        out = await client.post("/v1/completions", json={**base, "speculative": False})
        opted_out = (out.json()["choices"][0]["text"], await drafts())
        out = await client.post("/v1/completions", json=base)
        speculated = (out.json()["choices"][0]["text"], await drafts())
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "speculative": False,
            },
        )
        bad = await client.post("/v1/completions", json={**base, "speculative": "yes"})
        bad_chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "speculative": "sometimes",
            },
        )
        return opted_out, speculated, chat, bad, bad_chat

    opted_out, speculated, chat, bad, bad_chat = run(tmp_path, model_dir, scenario, speculative_config=NGRAM)
    assert opted_out[1] == 0  # the opted-out request proposed nothing
    assert speculated[1] > 0
    assert opted_out[0] == speculated[0]  # greedy: the same text either way
    assert chat.status_code == 200
    for response in (bad, bad_chat):
        assert response.status_code == 400
        assert "speculative" in response.json()["error"]["message"]
